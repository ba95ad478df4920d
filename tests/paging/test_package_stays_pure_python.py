import subprocess
import sys


def test_importing_paging_does_not_import_torch_or_numpy():
    # kv_sizing imports gguf (and so numpy) only when it reads a .gguf file.
    code = (
        "import sys, kvserve.paging, kvserve.paging.kv_sizing; "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
