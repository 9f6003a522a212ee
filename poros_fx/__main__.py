"""``python -m poros_fx``: the ``poros-fx`` command line (``torchrun --nproc-per-node N -m poros_fx train ...``)."""

from .cli import main

if __name__ == "__main__":
    main()
