import sys

from vllm_treespec.cli import main

sys.exit(main())
