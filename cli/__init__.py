"""The `cuflash2` command line (installed as cuflash2.cli)."""
