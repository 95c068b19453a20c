"""Workers sharing one known-schemas file: what each learns is kept."""

from __future__ import annotations

import threading

from schemas.catalogue import KnownSchemas

SCHEMA = {"type": "record", "name": "S", "fields": [{"name": "n", "type": "long"}]}


def test_two_workers_merging_at_once_lose_neither_entry(tmp_path):
    path = tmp_path / "known-schemas.json"
    first, second = KnownSchemas(path), KnownSchemas(path)
    read_file = second._read
    first_wrote = threading.Event()

    def read_while_the_first_merges() -> dict:
        # The second has read the file; the first merges its own entry meanwhile.
        seen = read_file()
        writer = threading.Thread(target=lambda: (first.remember_id(1, SCHEMA), first_wrote.set()))
        writer.start()
        # Without a lock the first's write lands now, before the second's; with one it
        # waits for the second's, and this wait runs out.
        first_wrote.wait(0.5)
        threads.append(writer)
        return seen

    threads: list[threading.Thread] = []
    second._read = read_while_the_first_merges
    second.remember_id(2, SCHEMA)
    for writer in threads:
        writer.join(10)
    assert set(KnownSchemas(path).ids) == {1, 2}
