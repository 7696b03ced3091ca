"""Decoding with a K/V cache gives the training forward's logits, token by token; `hotjax
generate` continues a prompt from a trained checkpoint, and refuses bad options in one line."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, TINY_RUN, error, one_line

from hotjax.cli import main
from hotjax.models.decode import Sampling, generate
from hotjax.models.llama import bind, init_params

TOL = 1e-4  # max |logit diff| between the cached decoding and the training forward, fp32
EOS, VOCAB = 258, 259  # the byte tokenizer's EOS and vocabulary
# Two prompts of different lengths (BOS first), padded to one width.
PROMPTS = [[257, 104, 111, 116, 106, 97, 120], [257, 100, 101, 102]]
NEW = 12


@pytest.fixture(scope="module")
def params():
    """TINY's parameters, matrices scaled up so that logits are far from uniform (no near-ties
    for argmax to break differently)."""
    return jax.tree.map(lambda x: x * 8 if x.ndim > 2 else x, init_params(TINY, seed=3))


def _generate(params, sampling: Sampling, seed: int = 0, eos_id: int = EOS, slots: int = 32):
    width = max(map(len, PROMPTS))
    prompt_BxP = np.array([p + [0] * (width - len(p)) for p in PROMPTS], np.int32)
    return generate(TINY, params, prompt_BxP, np.array([len(p) for p in PROMPTS], np.int32),
                    jax.random.key(seed), sampling, max_new_tokens=NEW, eos_id=eos_id,
                    vocab=VOCAB, slots=slots, keep_logits=True)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, top_p=0.9)],
                         ids=["greedy", "top-p"])
def test_decoded_logits_equal_the_training_forward_at_every_position(params, sampling):
    out = _generate(params, sampling)
    for b, prompt in enumerate(PROMPTS):
        n = int(out.lengths_B[b])
        assert n == len(prompt) + NEW  # no EOS drawn
        reference_TxV = bind(TINY, params)(out.tokens_BxS[b:b + 1, :n])[0]
        assert float(jnp.abs(out.logits_BxSxV[b, :n] - reference_TxV).max()) <= TOL


def test_greedy_decoding_takes_the_training_forwards_argmax_at_every_step(params):
    out = _generate(params, Sampling())
    for b, prompt in enumerate(PROMPTS):
        n = int(out.lengths_B[b])
        reference_TxV = bind(TINY, params)(out.tokens_BxS[b:b + 1, :n])[0]
        drawn = np.asarray(out.tokens_BxS[b, len(prompt):n])
        np.testing.assert_array_equal(drawn, np.argmax(reference_TxV[len(prompt) - 1:n - 1],
                                                       axis=-1))


@pytest.mark.parametrize("seed", [0, 1])
def test_top_p_near_zero_draws_the_greedy_tokens(params, seed):
    greedy = _generate(params, Sampling())
    nucleus = _generate(params, Sampling(temperature=1.0, top_p=1e-6), seed=seed)
    np.testing.assert_array_equal(nucleus.tokens_BxS, greedy.tokens_BxS)


def test_a_seed_repeats_its_draws_and_another_seed_draws_others(params):
    hot = Sampling(temperature=2.0, top_p=1.0)
    first, again, other = (_generate(params, hot, seed=s) for s in (5, 5, 6))
    np.testing.assert_array_equal(first.tokens_BxS, again.tokens_BxS)
    assert not np.array_equal(first.tokens_BxS, other.tokens_BxS)
    assert int(np.asarray(first.tokens_BxS).max()) < VOCAB  # never an embedding padding row


def test_a_row_ends_at_its_first_eos_and_the_others_go_on(params):
    greedy = _generate(params, Sampling())
    # The first row's third greedy token as EOS: that row stops there, the other need not.
    eos = int(greedy.tokens_BxS[0, len(PROMPTS[0]) + 2])
    out = _generate(params, Sampling(), eos_id=eos)
    assert int(out.lengths_B[0]) == len(PROMPTS[0]) + 3
    row = np.asarray(greedy.tokens_BxS[1, len(PROMPTS[1]):len(PROMPTS[1]) + NEW])
    stop = list(row).index(eos) + 1 if eos in row else NEW
    assert int(out.lengths_B[1]) == len(PROMPTS[1]) + stop
    np.testing.assert_array_equal(out.tokens_BxS[1, :int(out.lengths_B[1])],
                                  greedy.tokens_BxS[1, :int(out.lengths_B[1])])


def _corpus(tmp: Path) -> str:
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n"
                              for i in range(200)))
    return str(corpus)


def _trained(tmp: Path, *flags: str) -> str:
    """The checkpoint directory of a tiny model trained 2 steps on one device."""
    ckpt = tmp / "ckpt"
    assert main([*TINY_RUN, "--data", _corpus(tmp), "--steps", "2", "--devices", "1",
                 "--strategy", "data=1", "--ckpt-dir", str(ckpt), *flags]) == 0
    return str(ckpt)


def test_drawing_stops_when_a_row_fills_the_cache(params):
    greedy = _generate(params, Sampling())
    out = _generate(params, Sampling(), slots=16)  # the first row's 7 + 12 tokens need 19
    filled = 16 - len(PROMPTS[0])  # draws before the first row has no slot left
    assert out.lengths_B.tolist() == [len(p) + filled for p in PROMPTS]
    for b, n in enumerate(out.lengths_B.tolist()):
        np.testing.assert_array_equal(out.tokens_BxS[b, :n], greedy.tokens_BxS[b, :n])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """On byte tokens."""
    return _trained(tmp_path_factory.mktemp("bytes"))


def _greedy_text(checkpoint: str, prompt: str, new: int) -> str:
    """The reference: the checkpoint's training forward, argmax after argmax, no cache."""
    from hotjax.checkpoint import dirs, store
    from hotjax.checkpoint import meta as meta_lib
    from hotjax.checkpoint.model import saved
    from hotjax.data import load_tokenizer
    from hotjax.models.llama import abstract_params

    step_dir = dirs.find(checkpoint)
    config = saved(meta_lib.read(step_dir), step_dir)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    targets = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one),
                           abstract_params(config))
    params = store.restore(step_dir, {store.PARAMS: targets}).arrays[store.PARAMS]
    tokenizer = load_tokenizer("bytes", None)
    tokens = [tokenizer.bos_id, *tokenizer.encode(prompt)]
    # One width for every step (compiled once): a causal position never sees the padding.
    forward = jax.jit(lambda p, tokens_1xT: bind(config, p)(tokens_1xT)[0])
    row_T = np.zeros(len(tokens) + new, np.int32)
    drawn = []
    for _ in range(new):
        row_T[:len(tokens)] = tokens
        logits_V = forward(params, row_T[None])[len(tokens) - 1, :tokenizer.vocab_size]
        tokens.append(int(jnp.argmax(logits_V)))
        if tokens[-1] == tokenizer.eos_id:
            break
        drawn.append(tokens[-1])
    return tokenizer.decode(drawn)


@pytest.mark.parametrize("strategy", ["data=1", "tensor=2,rules=megatron"])
def test_generate_prints_the_greedy_continuation_of_the_training_forward(checkpoint, capsys,
                                                                        strategy):
    assert main(["generate", "--ckpt-dir", checkpoint, "--prompt", "def f", "--max-new-tokens",
                 "10", "--strategy", strategy]) == 0
    out, err = capsys.readouterr()
    assert out == _greedy_text(checkpoint, "def f", 10) + "\n" and out.strip()
    assert "10 tokens in" in err and "Traceback" not in err


def test_generate_draws_what_transformers_draws_from_the_exported_model(checkpoint, capsys,
                                                                        tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    assert main(["ckpt", "export-hf", checkpoint, str(tmp_path / "hf")]) == 0
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    prompt = [257, *b"def f"]
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                             pad_token_id=256)[0, len(prompt):].tolist()
    capsys.readouterr()
    assert main(["generate", "--ckpt-dir", checkpoint, "--prompt", "def f",
                 "--max-new-tokens", "10"]) == 0
    assert capsys.readouterr().out == bytes(i for i in ids if i < 256).decode(
        "utf-8", errors="replace") + "\n"


def test_a_checkpoint_carries_its_tokenizer_to_generate(tmp_path, capsys):
    from hotjax.data import open_corpus, train_bpe

    # TINY_RUN's --tokenizer bytes replaced by a BPE of the corpus, which the run saves.
    bpe = train_bpe(open_corpus(_corpus(tmp_path)), 300, tmp_path / "bpe")
    ckpt = _trained(tmp_path, "--tokenizer", bpe.source)
    (tmp_path / "bpe" / Path(bpe.source).name).unlink()  # only the checkpoint holds it now
    assert main(["generate", "--ckpt-dir", ckpt, "--prompt", "def f", "--max-new-tokens",
                 "4"]) == 0
    assert "4 tokens in" in capsys.readouterr().err
    line = error(["generate", "--ckpt-dir", ckpt, "--prompt", "x", "--tokenizer", "bytes"],
                 capsys)
    assert "--tokenizer bytes (bytes) is not the tokenizer" in line


def test_generate_samples_with_a_temperature_and_top_p(checkpoint, capsys):
    argv = ["generate", "--checkpoint", f"{checkpoint}/2", "--prompt", "def f",
            "--max-new-tokens", "6", "--temperature", "0.8", "--top-p", "0.9", "--seed", "4"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert capsys.readouterr().out == first  # the same seed, the same draws


@pytest.mark.parametrize("flags, message", [
    (["--prompt", ""], "--prompt is empty"),
    (["--temperature", "-1"], "--temperature -1.0: pass 0 (greedy) or a positive number"),
    (["--temperature", "nan"], "--temperature nan"),
    (["--top-p", "0"], "--top-p 0.0: pass a share of the probability above 0"),
    (["--top-p", "1.5"], "--top-p 1.5"),
    (["--max-new-tokens", "0"], "--max-new-tokens 0: pass a positive number"),
    (["--max-new-tokens", "5000"], "past the model's 1024"),
    (["--strategy", "data=16"], "uses 16 devices but 8 cpu devices are available"),
    (["--tokenizer", "nowhere.json"], "tokenizer file not found"),
])
def test_bad_options_are_one_line(checkpoint, capsys, flags, message):
    assert message in error(["generate", "--ckpt-dir", checkpoint, "--prompt", "x", *flags],
                            capsys)


@pytest.mark.parametrize("argv, message", [
    (["--ckpt-dir", "c", "--prompt", "x", "--top-p", "abc"], "invalid float value: 'abc'"),
    (["--prompt", "x"], "the following arguments are required: --checkpoint/--ckpt-dir"),
])
def test_options_argparse_refuses_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        main(["generate", *argv])
    assert exited.value.code == 2
    assert message in one_line(capsys.readouterr().err)


def test_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    line = error(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x"], capsys)
    assert "no such checkpoint directory" in line
