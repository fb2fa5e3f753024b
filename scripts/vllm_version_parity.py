"""Compare vLLM versions' schedule() outputs on one fixed admission sequence.

Run under each vLLM's interpreter, then compare (see :mod:`deploy.bench.version_parity`)::

    python scripts/vllm_version_parity.py run out/parity-0.32.json
    VLLM_TARGET_DEVICE=cpu /path/to/venv033/bin/python scripts/vllm_version_parity.py run out/parity-0.33.json
    python scripts/vllm_version_parity.py compare out/parity-0.32.json out/parity-0.33.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.bench.version_parity import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
