"""Shared code for the training scripts in scripts/.

Scripts import it as a sibling package (``from hvdtrain import ...``), so every
script stays launchable by path: ``horovodrun -np 2 python scripts/train_cnn.py``.
Model definitions never import Horovod or the run's machinery (runtime/, training/).
"""
