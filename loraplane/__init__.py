"""loraplane: serve hundreds of LoRA fine-tunes of one base model on a fixed GPU budget.

The import package maps the repository's top-level folders (see the README): each part lives in
its own folder and is imported as ``loraplane.<folder>``.
"""

__version__ = "0.1.0"
