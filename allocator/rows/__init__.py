"""An engine's rows on the page store: the row follower (`follower`), what the engine hands out
next (`front`), the order its free rows should go in (`packing`) and which held rows to move
(`compaction`)."""

from allocator.rows.follower import SMALL, RowFollower, as_rows
from allocator.rows.front import Front, plan

__all__ = ["SMALL", "Front", "RowFollower", "as_rows", "plan"]
