"""Runs of forced tokens: what a grammar alone decides, fed to the model in one forward pass
(jump-forward decoding). Runner thread only.

Under a JSON schema most tokens are not the model's choice: after `{"` the grammar allows only
the key's next piece, after the key only `":`, and so on (two thirds of a 20-field answer's
tokens on the tiny model and on the H200's synthetic 1B: each mask allowing one token). A
greedy sequence whose choice nothing but its mask shapes (`masked_choice.forced_tokens`) takes
such a token without the device; but each still cost a decode step, a whole forward pass, to put
it in the KV cache and get the next logits. `forced_run` reads ahead instead: while the mask
after each forced token again allows one token, that token is forced too, and the matcher
advances through the run. The sequence then feeds the run in one forward pass (whose last
position's logits give the next token the model chooses), so a run of n forced tokens costs one
pass instead of n.

The tokens are exactly those of step-by-step greedy decoding under the mask (each is the only
token its mask allows, so an argmax over the masked logits would name it whatever the logits
are); only the number of forward passes changes. Not for sampled rows (a sampler takes its next
draw at every step, forced or not: skipping steps would change the draws after), nor rows
with logits processors, penalties or bias (they see every step), nor logprobs (each forced token's
logprob would need its own position's logits); those keep one step a token.
"""

from __future__ import annotations

from trio_mlx.structured import masked_choice
from trio_mlx.structured.matcher import GrammarMatcher

#: The longest run fed in one pass (the pass is padded to this many tokens where shapes must
#: recur: `ActiveSequence` on MLX's CUDA backend), and so the most tokens one step emits.
MAX_RUN = 8


def forced_run(grammar: GrammarMatcher, width: int, limit: int) -> list[int]:
    """Consume and return the tokens `grammar` forces from where it stands, one after the other,
    at most `limit` of them: stops at a mask that allows more than one token (the model's choice
    comes next), or once the grammar is complete. The matcher is left past the run."""
    run: list[int] = []
    while len(run) < limit and not grammar.done:
        (forced,) = masked_choice.forced_tokens(grammar.allowed_words()[None], width)
        if forced is None:
            break
        grammar.consume(forced)
        run.append(forced)
    return run
