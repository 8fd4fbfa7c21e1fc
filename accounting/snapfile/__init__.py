"""The snapshot file: how an engine process hands its ledger to an exporter in another one.

Both ends live here, one concern per module, each importing only those above it in
this list:

- `format`: the file on disk, shared by both ends: its two lines, the `Envelope` (who
  published, when), rows written as columns, the interval and naming rules, why a
  publish failed (as the envelope carries it), and `Refused`: why a file is not served,
  from a fixed set of reasons;
- `summary`: the typed `Summary` a scrape reads (built from a file's first line, or from
  an in-process ledger's snapshot);
- `schema`: every JSON value and every part of a snapshot, checked and typed, rows and
  column tables;
- `checks`: the relations the figures must satisfy, recomputed (over columns, and row by
  row to name what broke);
- `head`: a file's lines checked: the first once per file version, as a `Head`
  (`load`), the buffer rows when someone asks for them (`buffer_map`);
- `directory`: the directory's rules (owner, mode, no links) and I/O relative to it;
- `writer`: the writer (`Publisher`), one file per source, replaced atomically; why a
  publish failed; the publisher's pid and start time as this host's kernel sees them;
- `reader`: the exporter's scan of the directory (`SnapshotFiles`), per-file refusals.

`docs/security.md` says what each end accepts and why.
"""
