"""How long the suite waits for a subprocess, a compiler or a process group before calling it hung.

The suite must pass on a busy 2-core machine (two test runs side by side), where a step that takes
15 s quietly can take several minutes. A limit here only catches a hang, so each is far above any duration a slow
machine produces; a hang in a step therefore shows as a failure, not as a run that never ends.
"""

from __future__ import annotations

# A child interpreter, a compile, a CLI run or a nested pytest.
HANG_SECONDS = 1800.0
# One collective of a multi-process test waiting for a peer that is alive but starved of CPU.
COLLECTIVE_SECONDS = 600.0
