"""The paper's large model: pass the method after a colon (default noloco).

    noloco-train --config=configs/paper_large.py:diloco --workdir=runs/paper_large_diloco

Sized for accelerators, not for CPU.
"""

from configs import paper


def get_config(method: str = "noloco"):
    return paper.paper_config("large", method or "noloco")
