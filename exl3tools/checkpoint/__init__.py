"""The only code that opens checkpoint files. Never imports torch."""

from exl3tools.checkpoint.header import DTYPES, Header, TensorInfo, parse_header, read_header
from exl3tools.checkpoint.reader import Checkpoint, TensorRef

__all__ = ["DTYPES", "Header", "TensorInfo", "parse_header", "read_header", "Checkpoint", "TensorRef"]
