"""The settings of the ``npu-int8`` backend (plain values with defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from irgen.plugin import IrgenError

#: hex word widths ``$readmemh`` files may use
WORD_BITS = (8, 16, 32, 64)


@dataclass
class Settings:
    """``channel_multiple``: channels are padded (with zeros) to a multiple of it
    (1: no padding). ``hex_word_bits``: the width of one word in the ``.hex`` files
    (one of :data:`WORD_BITS`); a tensor whose elements are wider uses words as
    wide as its elements."""

    channel_multiple: int = 16
    hex_word_bits: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.channel_multiple, int) or not 1 <= self.channel_multiple <= 4096:
            raise IrgenError(f"npu-int8: channel multiple {self.channel_multiple!r}: an integer from 1 to 4096")
        if self.hex_word_bits not in WORD_BITS:
            raise IrgenError(f"npu-int8: hex word width {self.hex_word_bits!r}: one of "
                             f"{', '.join(map(str, WORD_BITS))} bits")


#: the settings a run uses (``irgen_npu_int8.configure`` replaces them)
current = Settings()
