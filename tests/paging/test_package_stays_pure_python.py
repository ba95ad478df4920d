import subprocess
import sys


def test_importing_paging_does_not_import_torch_or_numpy():
    # Reading checkpoints (gguf, and so numpy) is the engine's job; paging only counts bytes.
    code = (
        "import sys, kvserve.paging, kvserve.paging.kv_sizing; "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
