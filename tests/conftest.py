"""Suite-wide: the processes tests start import the test tools too (tests/support)."""
from megatron_rl_testing import export_support_path

export_support_path()
