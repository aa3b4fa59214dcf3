import sys

from kimi_k3_moe.cli import main

sys.exit(main())
