import sys

from megatron_rl.plan.cli import main

sys.exit(main())
