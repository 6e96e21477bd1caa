"""groupcoord as a ``torch.distributed`` backend named ``"groupcoord"`` (CPU tensors).

Importing this package (``import coordinator`` does) registers the backend::

    import coordinator  # noqa: F401
    dist.init_process_group("groupcoord", ...)
    tp = dist.new_group([0, 1], backend="groupcoord")

* :mod:`~coordinator.torch_backend.registration`: the registration and torch's creator;
* :mod:`~coordinator.torch_backend.process_group`: the process group torch gets;
* :mod:`~coordinator.torch_backend.translate`: torch's arguments into the communicator's;
* :mod:`~coordinator.torch_backend.work`: the works it returns;
* :mod:`~coordinator.torch_backend.gloo_group`: the gloo group beneath.

See docs/torch_backend.md for what runs where.
"""

from coordinator.torch_backend.process_group import BACKEND_NAME, GroupcoordProcessGroup
from coordinator.torch_backend.registration import register
from coordinator.torch_backend.work import GroupcoordWork

__all__ = ["BACKEND_NAME", "GroupcoordProcessGroup", "GroupcoordWork", "register"]

register()
