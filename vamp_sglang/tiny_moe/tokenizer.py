"""The tokenizer every tiny checkpoint carries: a byte-level BPE trained here on a built-in corpus (no
download), wrapped in `PreTrainedTokenizerFast` with a ChatML chat template, so chat requests work."""

from __future__ import annotations

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _corpus() -> list[str]:
    """A fixed English corpus, repeated in a fixed order: enough merges for a ~2k vocabulary."""
    words = _CORPUS.split()
    lines = [" ".join(words[k:k + 12]) for k in range(0, len(words), 12)]
    numbers = [" ".join(str(n * 7 + k) for k in range(10)) for n in range(0, 1000, 10)]
    return lines + numbers + ["User: hello! Assistant: Hi, how can I help you today?"] * 4


def train_tokenizer(vocab: int):
    """Byte-level BPE trained on the built-in corpus, wrapped for transformers with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=1 << 20,
    )


_CORPUS = """
Once upon a time, in a small village between the mountains and the sea, there lived a baker who rose
every morning before the sun. She mixed flour, water, salt and yeast, and while the dough was rising she
walked to the harbour to watch the fishing boats come home. The fishermen waved to her, and she waved
back, and the gulls circled above them all, crying for bread. Her bakery was famous for its brown loaves,
its sweet cinnamon rolls, and the honey cakes that children bought on their way to school.
One winter the snow fell for seven days without stopping. The roads were closed, the boats stayed in
the harbour, and nobody could reach the market in the next town. The baker looked at her shelves and
counted what was left: three sacks of flour, a jar of honey, a basket of apples and a little butter.
She decided to bake for everyone, rich or poor, and to ask nothing in return until the spring.
Computers work in a similar way. A server receives requests from many users, keeps a queue of work,
and decides every moment which request should run next. Memory is limited, so the scheduler must choose
what to keep and what to throw away. When a conversation continues, the model can reuse the attention
keys and values it computed for earlier turns, which saves time. When memory runs out, the server may
evict old entries, pause a request and compute it again later, or move rarely used weights elsewhere.
Each choice has a cost, measured in milliseconds, and a good policy compares those costs before acting.
The library opened at nine o'clock on weekdays and at ten on Saturday. Students came to study
mathematics, history, chemistry, music and languages. The librarian knew where every book was kept:
novels on the second floor, maps and atlases near the window, dictionaries beside the reading tables,
and old newspapers in the basement, where the air smelled of paper and dust.
Good morning! How are you today? I am fine, thank you. Could you please tell me the way to the station?
Turn left at the corner, walk past the church, and you will see it on your right. It takes about ten
minutes on foot. Would you like a cup of tea or coffee? Yes, please, with milk and no sugar.
What is the weather like tomorrow? The forecast says it will be cloudy in the morning, with rain in the
afternoon and strong wind from the north. Remember to bring an umbrella and a warm jacket.
Science begins with questions. Why is the sky blue? Why do leaves change colour in autumn? How far away
is the moon, and how hot is the centre of the earth? Scientists answer such questions by observing
carefully, measuring, building models and testing predictions against new experiments. A theory that
survives many tests becomes trusted, but it can always be improved when better evidence appears.
The river flows from the glacier through forests, farms and cities until it reaches the ocean. Along
the way it carries sand, stones and fallen branches. Trout and salmon swim upstream each year, and
bears wait for them in the shallow water. In summer, families camp on the banks, light small fires,
cook sausages and tell stories under the stars until the children fall asleep.
An engineer should write clear code, test it honestly, and measure before optimising. Small functions
with good names are easier to read than long ones. Every error message should say what went wrong and
how to fix it. Documentation explains why a design was chosen, not only what the code does.
"""
