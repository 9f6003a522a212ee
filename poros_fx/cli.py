"""``python -m poros_fx.cli`` (e.g. ``torchrun --nproc-per-node N -m poros_fx.cli train ...``): the ``poros-fx``
command line, whose code is ``poros_fx/tools/cli.py``."""

from .tools.cli import main

if __name__ == "__main__":
    main()
