"""The paper's small model: pass the method after a colon (default noloco).

    noloco-train --config=configs/paper_small.py:diloco --workdir=runs/paper_small_diloco

Sized for accelerators, not for CPU.
"""

from configs import paper


def get_config(method: str = "noloco"):
    return paper.paper_config("small", method or "noloco")
