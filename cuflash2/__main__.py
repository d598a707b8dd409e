from cuflash2.cli.main import main

main()
