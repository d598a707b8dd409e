"""Tail of a causal grid under the hardware's in-order block dispatch: a model, no GPU needed.

Thread blocks start in linear order (blockIdx.x fastest) whenever a slot on an SM frees up. On a
causal grid the blocks' work differs (the forward's last query blocks visit the most key blocks,
the backward's first key blocks the most query blocks); the kernels order it longest-first only
within each (head, batch) group, so long blocks still start late in the grid and the last wave
waits for them. This greedy list-scheduling model compares the makespan of that order, of the
grouped order the kernels now use for causal grids (longest-first across chunks of groups sized to
one wave: config.groups_per_chunk, BlockGrid in kernels_cu/common/block_mask.cuh) and of a global
longest-first order with the ideal (total work / slots). It knows nothing of caches: the global
order measured 0.78-0.97x on the causal backward (the blocks running at once then read the Q/dO
and add to the dQ of as many groups; docs/design-notes.md, 'Causal grid order'). Work unit: one inner-loop
iteration (a key block for the forward, a query block for the backward), plus `--fixed` units per
block for its prologue and epilogue.

Usage: python benchmarks/schedule_model.py [--sms 132] [--fixed 1]
"""

import argparse
import heapq

from cuflash2.families import mma_sync as config


def makespan(works, slots):
    free_at = [0.0] * slots
    for w in works:
        heapq.heappush(free_at, heapq.heappop(free_at) + w)
    return max(free_at)


def causal_grid(mode, seqlen, head_dim, fixed):
    """(work per block in the kernels' launch order, slots per SM) for FA2's grid point."""
    batch, heads = 16384 // seqlen, 2048 // head_dim
    if mode == "fwd":
        c = config.forward_config(head_dim, "bf16", True, 90, seqlen=seqlen)
        m_blocks = seqlen // c.block_m
        # query block m visits key blocks up to the diagonal; the kernel runs the last one first
        per_group = [((m + 1) * c.block_m + c.block_n - 1) // c.block_n + fixed for m in reversed(range(m_blocks))]
        slots = 2 if c.warps == 4 else 1  # 4-warp tiles at ~255 registers: two blocks per SM
    else:
        c = config.backward_plan(head_dim, "bf16", True, 90).main[0]
        m_blocks, n_blocks = seqlen // c.block_m, seqlen // c.block_n
        per_group = [m_blocks - n * c.block_n // c.block_m + fixed for n in range(n_blocks)]
        slots = 1
    return [w for _ in range(batch * heads) for w in per_group], slots


def grouped_order(per_group, groups, slots):
    """Work per block in the grouped launch order: chunks of G groups, block i of every group of a
    chunk before block i + 1 of any."""
    size = config.groups_per_chunk(groups, len(per_group), slots)
    return [w for _ in range(groups // size) for w in per_group for _ in range(size)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--fixed", type=float, default=1.0)
    args = parser.parse_args()
    print(f"{'mode':4} {'seqlen':>6} {'hdim':>4}  {'per group':>10}  {'grouped':>8}  {'longest first':>13}"
          "   (makespan / ideal)")
    for mode in ("fwd", "bwd"):
        for head_dim in (64, 128, 256):
            for seqlen in (512, 1024, 2048, 4096, 8192, 16384):
                works, per_sm = causal_grid(mode, seqlen, head_dim, args.fixed)
                slots = per_sm * args.sms
                ideal = max(sum(works) / slots, max(works))
                groups = (16384 // seqlen) * (2048 // head_dim)
                grid = makespan(works, slots) / ideal
                grouped = makespan(grouped_order(works[:len(works) // groups], groups, slots), slots) / ideal
                lpt = makespan(sorted(works, reverse=True), slots) / ideal
                print(f"{mode:4} {seqlen:6d} {head_dim:4d}  {grid:10.3f}  {grouped:8.3f}  {lpt:13.3f}")


if __name__ == "__main__":
    main()
