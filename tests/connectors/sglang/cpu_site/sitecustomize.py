"""Run by Python at start-up in the SGLang server processes the tests start (only those): ``kvstore_sglang_cpu``.

The CPU adaptations (``kvstore_sglang_cpu.py``), and the tests' call probe
(``kvstore_sglang_probe.py``) when the harness asks for it.
"""

import kvstore_sglang_cpu
import kvstore_sglang_probe

kvstore_sglang_cpu.install(after=kvstore_sglang_probe.hooks())
