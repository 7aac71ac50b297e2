"""The exceptions one package raises and another catches, in one base module.

Any package may import this module (``tests/layering.py`` ``BASE_MODULES``); it imports
nothing, so raising one of these ties no package to the one that handles it. The server maps
each to an HTTP status (``radixkv.server``); ``radixkv serve`` maps ``StoreError`` at start to
exit 2. Exceptions raised and caught inside one package stay there (``radixkv.server.errors``'
``APIError``, ``radixkv.tools.chat``'s ``ChatError``). Bad arguments are ``ValueError`` naming
the field, as everywhere else.

=========================  ===============  ===================================================
exception                  raised by        server answer
=========================  ===============  ===================================================
``LoRAError``              model, engine    400: an adapter cannot be read or does not fit
``LoRANotFoundError``      engine           404: no adapter of that name is loaded
``LoRAInUseError``         engine           409: a request still holds the adapter
``EngineDeadError``        engine           503 ``engine_dead``
``QueueFullError``         engine           503 ``queue_full``: the admission bound (``max_queue``)
``TokenizeQueueFullError`` engine           503 ``queue_full``: the tokenizer pool's queue
``StoreError``             cache            none: a store-tier call failed (counted, the
                                            request goes on without the store)
=========================  ===============  ===================================================
"""

from __future__ import annotations

__all__ = ["EngineDeadError", "LoRAError", "LoRAInUseError", "LoRANotFoundError",
           "QueueFullError", "StoreError", "TokenizeQueueFullError"]


class LoRAError(ValueError):
    """An adapter cannot be read or does not fit the model (the message names what)."""


class LoRANotFoundError(LoRAError):
    """No adapter of that name is loaded (server: 404)."""


class LoRAInUseError(LoRAError):
    """A request holds the adapter (server: 409)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; no request can make progress (server: 503)."""


class QueueFullError(RuntimeError):
    """Admitting the request would queue more than ``max_queue`` sequences (server: 503)."""


class TokenizeQueueFullError(RuntimeError):
    """``max_queue`` jobs already wait for a tokenizer worker (server: 503 ``queue_full``)."""


class StoreError(Exception):
    """A store-tier backend call failed (store down, timeout, refused): counted, never fatal;
    at ``radixkv serve`` start, a backend that cannot be reached (exit 2)."""
