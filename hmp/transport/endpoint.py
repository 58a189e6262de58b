"""The endpoints' names as ``hmp.transport.endpoint`` (the module they grew in) spells them: see
:mod:`hmp.transport`."""

from hmp.transport import *  # noqa: F403
from hmp.transport import __all__  # noqa: F401
