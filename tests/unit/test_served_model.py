"""ServedModel's grammars: made once, even when the first requests with a grammar come together."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from kvmesh.engine.checkpoint import ModelFiles
from kvmesh.runtime.served_model import ServedModel


def test_requests_that_come_together_build_the_grammars_once(monkeypatch):
    """Four threads ask at once (the default executor's, as four first json_schema requests do):
    the tokenizer is loaded once and all get the same Grammars. Before the lock each loaded its
    own, importing transformers on four threads at once, which failed one with ImportError under
    the soak."""
    import kvmesh.engine.checkpoint as checkpoint
    import kvmesh.engine.grammar as grammar

    loads = []

    def slow_tokenizer(files):
        loads.append(threading.get_ident())
        time.sleep(0.2)  # the window in which the others arrive
        return object()

    monkeypatch.setattr(checkpoint, "load_tokenizer", slow_tokenizer)
    monkeypatch.setattr(grammar, "Grammars", lambda tokenizer, vocab, eos: (tokenizer, vocab, tuple(eos)))
    files = ModelFiles("m", Path("/nonexistent"))  # never read: the tokenizer is stubbed
    model = ServedModel("prefill-x", 100, 64, "fp", frozenset({2}), files)
    got, start = [], threading.Barrier(4)

    def ask():
        start.wait()
        got.append(model.grammars())

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(loads) == 1, loads
    assert len(got) == 4 and all(g is got[0] for g in got)
