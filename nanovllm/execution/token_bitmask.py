"""A structured-output step's token bitmask, from the host to the logits it masks."""

import numpy as np
import torch

from nanovllm.kernels.token_bitmask import apply_token_bitmask_dispatch_


class BitmaskUpload:
    """Pinned host buffers for the bitmask and its rows, grown on demand, so that the copy to
    the device does not wait for the step running there."""

    def __init__(self, device: torch.device, max_rows: int, vocab_size: int):
        self.device = device
        self.num_words = -(-vocab_size // 32)
        self.max_rows = max_rows
        self.host_bitmask: torch.Tensor | None = None
        self.host_rows: torch.Tensor | None = None

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.host_bitmask is None:
            pin = self.device.type == "cuda"
            self.host_bitmask = torch.empty(
                (self.max_rows, self.num_words), dtype=torch.int32, pin_memory=pin
            )
            self.host_rows = torch.empty(self.max_rows, dtype=torch.int64, pin_memory=pin)
        return self.host_bitmask, self.host_rows

    def host_rows_view(self, rows: int) -> np.ndarray:
        """The first ``rows`` rows of the pinned bitmask buffer, to be filled in place and passed
        to :meth:`apply` (which then copies nothing on the host)."""
        if rows > self.max_rows:
            raise ValueError(f"{rows} bitmask rows, at most {self.max_rows}")
        return self._buffers()[0][:rows].numpy()

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
        """Mask ``logits`` rows ``rows`` with ``bitmask`` (one int32 row each)."""
        if bitmask.shape != (len(rows), self.num_words) or bitmask.dtype != np.int32:
            raise ValueError(
                f"the token bitmask must be int32 of shape {(len(rows), self.num_words)}, "
                f"got {bitmask.dtype} {bitmask.shape}"
            )
        host_bitmask, host_rows = self._buffers()
        n = len(rows)
        # the previous step's copy is done: its samples were read back before this fill
        if bitmask.ctypes.data != host_bitmask.data_ptr():  # not filled in place
            host_bitmask[:n].numpy()[:] = bitmask
        host_rows[:n].numpy()[:] = rows
        device_bitmask = host_bitmask[:n].to(self.device, non_blocking=True)
        device_rows = host_rows[:n].to(self.device, non_blocking=True)
        apply_token_bitmask_dispatch_(logits, device_bitmask, device_rows)
