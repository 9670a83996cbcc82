"""Pipeline timelines as PNG images, with no plotting dependency: an RGB pixel array written with
zlib. Rows are stages (stage 0 on top), columns are ticks as wide as their lockstep cost (a tick
lasts as long as its slowest stage's slot); each action is a cell as wide as its own cost:
forwards blue, backwards green, zero-bubble weight gradients orange (darker for later virtual
chunks), idle time (the bubble) light grey; each cell carries its microbatch number."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

CELL, GAP = 20, 2
IDLE_RGB = (228, 228, 228)
FORWARD_RGB = [(66, 133, 244), (26, 86, 190), (12, 52, 130)]  # by chunk
BACKWARD_RGB = [(52, 168, 83), (24, 118, 52), (10, 78, 30)]
WEIGHT_RGB = [(244, 160, 0), (200, 120, 0), (150, 85, 0)]
PALETTE = {"F": FORWARD_RGB, "B": BACKWARD_RGB, "W": WEIGHT_RGB}

# 3x5 digits, one string of 15 bits per digit (rows top to bottom)
DIGITS = ["111101101101111", "010110010010111", "111001111100111", "111001111001111", "101101111001001",
          "111100111001111", "111100111101111", "111001001001001", "111101111101111", "111101111001111"]


def timeline_pixels(tt) -> np.ndarray:
    """A schedules.Timetable -> [height, width, 3] uint8 image; one cost unit is CELL pixels wide."""
    stages, tick_costs = tt.stages, tt.tick_costs
    image = np.full((stages * (CELL + GAP) + GAP, sum(tick_costs) * (CELL + GAP) + GAP, 3), 255, np.uint8)
    x0 = GAP
    for row, cost in zip(tt.ticks, tick_costs):
        for s, slot in enumerate(row):
            y, x = GAP + s * (CELL + GAP), x0
            image[y:y + CELL, x:x + cost * (CELL + GAP) - GAP] = IDLE_RGB
            for action in slot:
                width = tt.costs[action.kind] * (CELL + GAP) - GAP
                palette = PALETTE[action.kind]
                image[y:y + CELL, x:x + width] = palette[min(action.chunk, len(palette) - 1)]
                _write_number(image, action.micro, y + (CELL - 10) // 2, x + width // 2)
                x += width + GAP
        x0 += cost * (CELL + GAP)
    return image


def _write_number(image, number: int, top: int, center: int) -> None:
    text = str(number)
    left = center - (len(text) * 8 - 2) // 2
    for i, ch in enumerate(text):
        bits = np.array([int(b) for b in DIGITS[int(ch)]], bool).reshape(5, 3)
        glyph = np.kron(bits, np.ones((2, 2), bool))  # 6 x 10 pixels
        x = left + i * 8
        image[top:top + 10, x:x + 6][glyph] = 255


def write_png(path: str | Path, image: np.ndarray) -> None:
    """Minimal PNG writer: 8-bit RGB, no interlace."""
    height, width, _ = image.shape
    raw = b"".join(b"\x00" + image[y].tobytes() for y in range(height))  # filter type 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    Path(path).write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
                           + chunk(b"IEND", b""))
