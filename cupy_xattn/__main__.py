"""``python -m cupy_xattn``: the ``cupy-xattn`` command line."""
from .cli import main

main()
