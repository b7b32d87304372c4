"""The exit codes every ``gpuguard`` command returns (docs/design.md, CLI outputs): one
definition, so no command drifts from the others."""

from __future__ import annotations

from typing import Final

EXIT_OK: Final = 0
"""Done, and the answer is good (check-pod, check-sharing: valid; explain, inspect: reported)."""
EXIT_INVALID: Final = 1
"""The input was read and is wrong, or the check failed (an invalid manifest, a limit that does
not apply, a sharing config the device plugin would reject)."""
EXIT_FAILED: Final = 1
"""The command could not do its job (a ``PermanentError`` that is not a config error, a
process that cannot be read). Same number as ``EXIT_INVALID``: scripts see 0, 1 or 2."""
EXIT_USAGE: Final = 2
"""argparse's own exit code for a usage error; also every ``ConfigError``'s."""
