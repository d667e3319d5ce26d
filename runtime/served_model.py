"""What one prefill or decode instance serves, as its servicer checks requests against it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvmesh.engine.checkpoint import ModelFiles, model_fingerprint
from kvmesh.engine.loader import load_config


@dataclass(frozen=True)
class ServedModel:
    """The model behind one instance's servicer, and the instance's name for it.

    Built once in each service's main() from the checkpoint (`kvmesh.engine.loader.load_config`,
    `kvmesh.engine.checkpoint.model_fingerprint`).
    """

    instance_id: str
    """The instance's name in spans, logs, stats and the prefix index."""
    vocab_size: int
    """Token ids must be in [0, vocab_size)."""
    max_context: int
    """Tokens one sequence may hold, prompt and answer together."""
    fingerprint: str
    """Identifies the checkpoint: a gateway refuses instances whose fingerprints differ."""
    eos_token_ids: frozenset[int] = frozenset()
    """The ids that end an answer (decode stops on them unless the request ignores EOS)."""
    files: ModelFiles | None = None
    """The checkpoint (its tokenizer compiles grammars); None: structured output is refused."""
    _grammars: list = field(default_factory=list, compare=False, repr=False)
    _grammars_lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def grammars(self):
        """The instance's kvmesh.engine.grammar.Grammars (its tokenizer, vocabulary and EOS ids), made
        on the first request with a grammar (it loads xgrammar and the tokenizer), once: requests
        that come together wait for the first one's (they run on the default executor's threads,
        and two first imports of transformers at once failed one with ImportError, "cannot import
        name 'AutoTokenizer'", under the soak). Raises ValueError when the instance has no
        checkpoint files to read a tokenizer from."""
        with self._grammars_lock:
            if not self._grammars:
                if self.files is None:
                    raise ValueError("this instance serves no tokenizer: structured output is not available")
                from kvmesh.engine.checkpoint import load_tokenizer
                from kvmesh.engine.grammar import Grammars

                tokenizer = load_tokenizer(self.files)
                self._grammars.append(Grammars(tokenizer, self.vocab_size, sorted(self.eos_token_ids)))
            return self._grammars[0]

    @classmethod
    def of(cls, files: ModelFiles, instance_id: str) -> ServedModel:
        """The checkpoint `files` as served by `instance_id`. Raises ValueError when its config is
        missing a field or invalid (`kvmesh.engine.loader.load_config`)."""
        config = load_config(files)
        return cls(
            instance_id,
            config.vocab_size,
            config.max_position_embeddings,
            model_fingerprint(files),
            frozenset(config.eos_token_ids),
            files,
        )


def grammar_state(model: ServedModel, spec):
    """A matcher at the answer's start for grammar `spec` (kvmesh.engine.sampling_params.GrammarSpec)
    on `model`'s tokenizer, checked: an kvmesh.engine.grammar.GrammarState. Raises ValueError, prefixed
    "grammar: ", when the spec does not compile or no text can match it."""
    from kvmesh.engine.grammar import GrammarState

    try:
        grammars = model.grammars()
        grammars.check(spec)
        return GrammarState(grammars, grammars.matcher(spec))
    except ValueError as exc:
        raise ValueError(f"grammar: {exc}") from None
