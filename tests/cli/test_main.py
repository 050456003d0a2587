"""The command line stays light: building every command's parser loads no library module (each
handler imports what it runs), so `relaytrain --help` answers at once."""

import subprocess
import sys


def test_building_the_parser_loads_only_the_command_line():
    code = ("import sys; from relaytrain.cli import build_parser; build_parser(); "
            "print('\\n'.join(m for m in sys.modules if m.split('.')[0] in "
            "('relaytrain', 'torch', 'numpy')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    assert "relaytrain.cli.data" in loaded
    assert [m for m in loaded if m not in ("relaytrain", "relaytrain.errors")
            and not m.startswith("relaytrain.cli")] == []
