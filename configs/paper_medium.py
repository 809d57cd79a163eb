"""The paper's medium model: pass the method after a colon (default noloco).

    noloco-train --config=configs/paper_medium.py:diloco --workdir=runs/paper_medium_diloco

Sized for accelerators, not for CPU.
"""

from configs import paper


def get_config(method: str = "noloco"):
    return paper.paper_config("medium", method or "noloco")
