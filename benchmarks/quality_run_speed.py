"""The quality benchmark's unit of work before and after the fused quantizers: continuations of
compare_policies' deep8 setting (its pretrained checkpoint, from SNIP_BENCH_DIR as compare_policies
caches it) with the compiled quantizers (the default) and with the reference ones (torchao's
quantizers composed: what lightning_snip ran before), interleaved, the same seed: identical held-out
losses are the check that only the speed differs.

    python benchmarks/quality_run_speed.py [--repeats 2] [--jobs all_fp4:1.0 snip:0.75]

Run compare_policies.py --setting deep8 once first (it writes the checkpoint). Prints
``run <repeat> <policy> <fraction> <mode> seconds <fit seconds> wall <s> eval_loss <loss>``.
"""
import argparse
import json
import tempfile
import time

import compare_policies as cp  # the benchmark whose unit of work this times (a script's folder is on its path)
from harness import bench_dir, quantizer_mode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--jobs", nargs="+", default=["all_fp4:1.0", "snip:0.75"], help="policy:fraction, seed 0")
    args = parser.parse_args()
    s = cp.SETTINGS["deep8"]
    work = bench_dir("deep8")
    if not (work / "pretrained.ckpt").exists():
        raise SystemExit(f"{work / 'pretrained.ckpt'} missing: run benchmarks/compare_policies.py --setting deep8 first")
    measured = json.loads((work / "measured.json").read_text())["measured"]
    jobs = [(j.split(":")[0], float(j.split(":")[1])) for j in args.jobs]
    for rep in range(args.repeats):
        for policy, fraction in jobs:
            for mode in ("compiled", "reference"):
                with quantizer_mode(mode), tempfile.TemporaryDirectory() as root:
                    t = time.perf_counter()
                    row = cp.run_one(s, str(work / "pretrained.ckpt"), policy, fraction, 0, measured, root)
                    print(f"run {rep} {policy} {fraction} {mode} seconds {row['seconds']:.1f} "
                          f"wall {time.perf_counter() - t:.1f} eval_loss {row['eval_loss']:.6f}", flush=True)


if __name__ == "__main__":
    main()
