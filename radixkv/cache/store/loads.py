"""One request's store load as the engine thread and the tier's loader thread share it
(``StoreTier.start_load`` makes it, ``StoreTier._run_load`` fills it)."""

from __future__ import annotations


class LoadJob:
    """One request's store lookup (see the module docstring); engine-thread fields are plain,
    ``done`` / ``abandoned`` change under the tier's lock."""

    __slots__ = ("request_id", "root", "parent_hash", "hashes", "token_bytes", "depth_blocks",
                 "deadline_s", "done", "abandoned", "slots", "num_present", "num_rejected",
                 "error", "reset_epoch")

    def __init__(self, request_id: str, root: bytes, parent_hash: bytes, hashes: list[bytes],
                 token_bytes: bytes, depth_blocks: int, deadline_s: float) -> None:
        self.request_id = request_id
        self.root = root
        self.parent_hash = parent_hash
        self.hashes = hashes
        self.token_bytes = token_bytes
        self.depth_blocks = depth_blocks
        self.deadline_s = deadline_s
        self.done = False
        self.abandoned = False
        self.slots: list[int] = []
        self.num_present = -1  # blocks the store held (-1: not known yet)
        self.num_rejected = 0  # present blocks not served: a value failed its check
        self.error = False
        self.reset_epoch = 0  # the tier's reset count when the job started (StoreTier.reset)

