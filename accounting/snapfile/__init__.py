"""The snapshot file: how an engine process hands its ledger to an exporter in another one.

Both ends live here, one concept per module:

- `envelope`: the file's layout (two lines: envelope and summary, then buffer rows),
  its name, the interval rule, `Envelope` (who published, when);
- `directory`: the directory's rules (owner, mode, no links) and I/O relative to it;
- `process`: a publisher's pid and start time as this host's kernel sees them;
- `publisher`: the writer (`Publisher`), one file per source, replaced atomically;
- `reader`: the exporter's scan of the directory (`SnapshotFiles`), per-file refusals;
- `refusal`: why a file is not served, from a fixed set of reasons;
- `schema`: every JSON value and every part of a snapshot, checked and typed;
- `checks`: the relations the figures must satisfy, recomputed;
- `head`: the first line, checked once per file version, as a `Summary`;
- `summary`: the typed `Summary` a scrape reads (also built from an in-process ledger);
- `buffermap`: the buffer rows, checked when someone asks for them.

`docs/security.md` says what each end accepts and why.
"""
