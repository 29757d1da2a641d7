"""The reliability soak, as a benchmark script: the same as `vllm-treespec soak`.

    python benchmarks/soak.py --requests 600 --out DIR

See `vllm_treespec/bench/soak.py` (and README, "Reliability") for what it runs and
what it checks; it exits non-zero on any violation.
"""

import sys

from vllm_treespec.bench.soak import main

if __name__ == "__main__":
    sys.exit(main())
