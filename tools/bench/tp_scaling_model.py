#!/usr/bin/env python3
"""A model of decode speed across sockets and machines, built from measured inputs, for docs/benchmarks.md.

Per decoded token and sequence (decode reads every weight once; the KV cache is left out):

    one process       t1 = W / B
    tensor parallel   tN = W / (N B) + 2 L a(N) + g(N)       a: one allreduce of d floats, g: the logits gather
    pipeline (ours)   tN = W / B + (N - 1) h                   one batch in flight: the stages take turns
    N replicas        tN = t1 per sequence, N sequences at once (N x the throughput, same latency)

W: weight bytes read per token, B: one socket's (or machine's) memory bandwidth, L: layers, d: hidden size.
a(N) and h come from the latency of a d-float message: within a machine MPI's shared-memory allreduce as
measured here (tools/bench/bench_allreduce.py); across machines a fixed per-message latency plus the ring
allreduce's 2 (N-1)/N d 4 bytes over the link. Which inputs are measured and which assumed is printed with
the table.

    python tools/bench/tp_scaling_model.py [--shm-us 5.0] [--net-latency-us 20] [--socket-gbs 200]
"""
import argparse

MODELS = {   # name: (weight bytes per token at Q4_K_M-like 4.8 bits, layers, hidden size)
    "Qwen2.5-1.5B Q4_K_M": (1.04e9, 28, 1536),
    "Llama-3-8B Q4_K_M": (4.9e9, 32, 4096),
    "Llama-3-70B Q4_K_M": (42.5e9, 80, 8192),
}


VOCAB = 150000        # logits per row gathered on rank 0
SHM_LINK = 20e9       # bytes/s of a shared-memory copy between sockets (assumed)


def allreduce_s(n_ranks, d, latency_s, link_bytes_per_s):
    """One allreduce of d float32 over n_ranks as a ring: 2 (N-1) steps, each half a 2-rank allreduce's
    latency (which has 2), plus the 2 (N-1)/N d 4 bytes each rank sends."""
    if n_ranks == 1:
        return 0.0
    return (n_ranks - 1) * latency_s + 2 * (n_ranks - 1) / n_ranks * d * 4 / link_bytes_per_s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shm-us", type=float, default=5.0,
                    help="measured: one 2-rank shared-memory allreduce of a decode row, microseconds")
    ap.add_argument("--net-latency-us", type=float, default=20.0,
                    help="a 2-rank allreduce of a decode row across machines, microseconds (TCP loopback, measured "
                         "here, is a lower bound)")
    ap.add_argument("--socket-gbs", type=float, default=200.0,
                    help="assumed memory bandwidth of one socket or machine, GB/s")
    ap.add_argument("--hop-us", type=float, default=None,
                    help="a pipeline stage's hand-over across machines (default: the per-message latency)")
    a = ap.parse_args()
    B = a.socket_gbs * 1e9
    print(f"inputs: a 2-rank allreduce of one row {a.shm_us} us over shared memory, {a.net_latency_us} us across "
          f"machines, {a.socket_gbs:.0f} GB/s per socket/machine (assumed)\n")
    print("| model | where | N | one process ms | TP ms (x) | pipeline ms (x) | replicas tokens/s (x) |")
    print("|---|---|---|---|---|---|---|")
    for name, (W, L, d) in MODELS.items():
        t1 = W / B
        for where, lat, link in (("sockets (shm)", a.shm_us * 1e-6, SHM_LINK), ("25 Gb/s", a.net_latency_us * 1e-6, 25e9 / 8),
                                 ("100 Gb/s", a.net_latency_us * 1e-6, 100e9 / 8)):
            for N in (2, 4, 8):
                ar = allreduce_s(N, d, lat, link)
                gather = lat + 4 * VOCAB * (N - 1) / N / link     # the other ranks' logits of one row
                tp = W / (N * B) + 2 * L * ar + gather
                hop = (a.hop_us * 1e-6 if a.hop_us is not None else lat) + d * 4 / link
                pp = t1 + (N - 1) * hop
                print(f"| {name} | {where} | {N} | {t1 * 1e3:.2f} | {tp * 1e3:.2f} (x{t1 / tp:.2f}) | "
                      f"{pp * 1e3:.2f} (x{t1 / pp:.2f}) | {N / t1:.0f} (x{N}) |")


if __name__ == "__main__":
    main()
