"""fp8jax.convert on linen and NNX models that use every convertible layer kind (Dense,
DenseGeneral, Einsum / Linear, Einsum), unrolled under remat and stacked under scan: bit for
bit the hand-wired FP8 model; rules checked on the lowered program; O0 is the model itself;
FP8 ran (error above BF16's, bounded) with the unconverted model's parameters."""
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
import fp8jax.dot as fdot
import fp8jax.linen as flinen
import fp8jax.nnx as fnnx
from conftest import rel_err
from fp8jax import ConvertRules

V, D, H, K = 48, 32, 2, 16   # vocab, width, heads, head dim (V: only the head / attend)
B, T = 2, 8
DIFF = nnx.DiffState(0, fnnx.PARAM_AND_FP8)


def _tokens(key):
  return jax.random.randint(key, (B, T), 0, V)


def _loss(logits, tokens):
  return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], -1))


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def _spec(tree):
  return jax.tree.map(lambda a: (tuple(a.shape), jnp.dtype(a.dtype)), tree)


# ------------------------------------------------------------------------------------ linen

class LBlock(nn.Module):
  """DenseGeneral -> Einsum (attention-like), Dense (MLP-like). `recipe`: hand-wired FP8
  layers (None: plain flax layers)."""
  recipe: fp8jax.Recipe | None = None
  dtype: jnp.dtype = jnp.bfloat16

  @nn.compact
  def __call__(self, x, _=None):
    kw = dict(dtype=self.dtype)
    einsum = nn.Einsum
    if self.recipe is not None:
      kw["dot_general_cls"] = functools.partial(flinen.Fp8DotGeneral, recipe=self.recipe)
      einsum = functools.partial(flinen.Einsum, recipe=self.recipe)
    h = nn.gelu(nn.DenseGeneral((H, K), **kw)(x))
    x = x + einsum((H, K, D), "bthk,hkd->btd", dtype=self.dtype)(h)
    return x + nn.Dense(D, **kw)(nn.gelu(x)), None


class LModel(nn.Module):
  """Embedding, `unrolled` blocks under nn.remat ("blocks_<i>"), `scanned` blocks under
  nn.scan(nn.remat) ("layers"), an LM head ("head") plus the embedding's attend."""
  recipe: fp8jax.Recipe | None = None
  unrolled: int = 1
  scanned: int = 2
  dtype: jnp.dtype = jnp.bfloat16
  scan_fp8: bool = True   # list FP8_COLLECTION in the scan's variable_axes

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(V, D, name="embed")
    x = embed(tokens)
    for i in range(self.unrolled):
      x = nn.remat(LBlock)(self.recipe, self.dtype, name=f"blocks_{i}")(x)[0]
    if self.scanned:
      axes = {"params": 0, **({fp8jax.FP8_COLLECTION: 0} if self.scan_fp8 else {})}
      stack = nn.scan(nn.remat(LBlock), variable_axes=axes, split_rngs={"params": True},
                      length=self.scanned)
      x = stack(self.recipe, self.dtype, name="layers")(x, None)[0]
    logits = nn.Dense(V, dtype=self.dtype, name="head")(x)
    return (logits + 0.1 * embed.attend(x.astype(jnp.float32))).astype(jnp.float32)


def _linen_steps(model, variables, tokens, steps=2):
  """(loss, gradients of all collections, variables after an SGD step and the FP8 state
  update) of `steps` steps."""
  @jax.jit
  def step(variables):
    loss, grads = jax.value_and_grad(lambda v: _loss(model.apply(v, tokens), tokens))(variables)
    new = fp8jax.apply_fp8_updates(variables, grads)
    new["params"] = jax.tree.map(lambda p, g: p - 0.5 * g, new["params"], grads["params"])
    return loss, grads, new

  out = []
  for _ in range(steps):
    out.append(step(variables))
    variables = out[-1][2]
  return out


def test_linen_convert_is_the_hand_wired_model_bit_for_bit(key):
  k_init, k_tok = jax.random.split(key)
  tokens = _tokens(k_tok)
  model, report = fp8jax.convert(LModel(), "O1", tokens)
  wired = LModel(recipe=fp8jax.Recipe())
  variables = jax.jit(model.init)(k_init, tokens)
  _assert_trees_equal(variables, jax.jit(wired.init)(k_init, tokens))  # FP8 state included
  for (loss, grads, new), (loss_w, grads_w, new_w) in zip(
      _linen_steps(model, variables, tokens), _linen_steps(wired, variables, tokens)):
    assert np.isfinite(loss)
    np.testing.assert_array_equal(loss, loss_w)
    _assert_trees_equal(grads, grads_w)
    _assert_trees_equal(new, new_w)
  # the FP8 state was updated in both steps, per scanned layer
  hist = new[fp8jax.FP8_COLLECTION]["layers"]["Einsum_0"]["fp8"]["output_grad"].amax_history
  assert hist.shape == (2, 16) and np.all(hist[:, :2] > 0)
  gemms = ("DenseGeneral_0", "Einsum_0", "Dense_0")
  assert set(report.converted) == {f"{b}/{g}" for b in ("blocks_0", "layers") for g in gemms}
  assert (report["head"].reason, report["embed"].reason) == ("head", "embedding")
  assert report["head"].format == "bfloat16" and report["embed"].kind == "Embed.attend"
  assert report["layers/Dense_0"].layers == 2 and report["blocks_0/Einsum_0"].format == "E4M3/E5M2"


def test_linen_scan_without_fp8_collection_is_refused_with_the_fix(key):
  with pytest.raises(ValueError, match=r"variable_axes.*fp8jax\.FP8_COLLECTION: 0"):
    fp8jax.convert(LModel(scan_fp8=False), "O1", _tokens(key))


def test_linen_needs_example_inputs_and_converts_once():
  with pytest.raises(ValueError, match="example inputs"):
    fp8jax.convert(LModel(), "O1")
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)   # shapes are enough
  model, _ = fp8jax.convert(LModel(), "O1", tokens)
  with pytest.raises(ValueError, match="converted already"):
    fp8jax.convert(model, "O1", tokens)


def test_linen_converted_model_works_as_a_submodule():
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
  model, _ = fp8jax.convert(LModel(scanned=0), "O1", tokens)

  class Outer(nn.Module):
    inner: nn.Module

    def __call__(self, tokens):
      return self.inner(tokens)

  shapes = jax.eval_shape(Outer(model).init, jax.random.key(0), tokens)
  meta = shapes[fp8jax.FP8_COLLECTION]["inner"]
  assert set(meta) == {"blocks_0"} and set(meta["blocks_0"]) == {"DenseGeneral_0", "Einsum_0",
                                                                 "Dense_0"}


def test_unmatched_rules_are_refused_naming_the_rule():
  tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)
  with pytest.raises(ValueError, match=r"rule '.\*/mlp/.\*' matches no GEMM path"):
    fp8jax.convert(LModel(), "O1", tokens, rules=ConvertRules(keep=(".*/mlp/.*",)))
  with pytest.raises(ValueError, match="keep_last_blocks=1 cannot apply.*stacked under a scan"):
    fp8jax.convert(LModel(), "O1", tokens, rules=ConvertRules(keep_last_blocks=1))
  with pytest.raises(ValueError, match=r"rule 'blocks/9/.\*' matches no GEMM path"):
    fp8jax.convert(NModel(scanned=0, rngs=nnx.Rngs(0)), "O1",
                   rules=ConvertRules(keep=("blocks/9/.*",)))


# -------------------------------------------------------------------------------------- NNX

class NBlock(nnx.Module):
  """Two Einsums (attention-like) and a Linear (MLP-like); `recipe`: hand-wired FP8 layers."""

  def __init__(self, recipe, rngs):
    lin = nnx.Linear if recipe is None else functools.partial(fnnx.Linear, recipe=recipe)
    ein = nnx.Einsum if recipe is None else functools.partial(fnnx.Einsum, recipe=recipe)
    kw = dict(dtype=jnp.bfloat16, rngs=rngs)
    self.qk = ein("btd,dhk->bthk", (D, H, K), (H, K), **kw)
    self.out = ein("bthk,hkd->btd", (H, K, D), (D,), **kw)
    self.fc = lin(D, D, **kw)

  def __call__(self, x):
    x = x + self.out(nnx.gelu(self.qk(x)))
    return x + self.fc(nnx.gelu(x))


@nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
def _scan_blocks(x, block):
  return block(x), None


class NModel(nnx.Module):
  """Embedding, `unrolled` blocks (nnx.List, each applied under nnx.remat), `scanned` blocks
  stacked by nnx.vmap and applied by nnx.scan, an LM head and the embedding's attend."""

  def __init__(self, recipe=None, unrolled=1, scanned=2, *, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.blocks = nnx.List([NBlock(recipe, rngs) for _ in range(unrolled)])
    make = nnx.split_rngs(splits=scanned)(
        nnx.vmap(lambda r: NBlock(recipe, r), in_axes=(0,), out_axes=0)) if scanned else None
    self.layers = make(rngs) if scanned else None
    self.head = nnx.Linear(D, V, dtype=jnp.bfloat16, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = nnx.remat(lambda b, x: b(x))(block, x)
    if self.layers is not None:
      x = _scan_blocks(x, self.layers)[0]
    return (self.head(x) + 0.1 * self.embed.attend(x.astype(jnp.float32))).astype(jnp.float32)


def _nnx_steps(model, tokens, steps=2):
  """(loss, gradients of params and FP8 state, model state after an SGD step and the FP8
  state update) of `steps` steps."""
  @nnx.jit
  def step(model):
    loss, grads = nnx.value_and_grad(lambda m: _loss(m(tokens), tokens), argnums=DIFF)(model)
    param_grads = fnnx.apply_fp8_updates(model, grads)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.5 * g, nnx.state(model, nnx.Param),
                                   param_grads))
    return loss, grads

  return [(*step(model), nnx.state(model)) for _ in range(steps)]


def test_nnx_convert_is_the_hand_wired_model_bit_for_bit(key):
  seed = int(jax.random.randint(key, (), 0, 1 << 30))
  tokens = _tokens(key)
  plain = NModel(rngs=nnx.Rngs(seed))
  kernel = plain.blocks[0].fc.kernel
  params_before = jax.tree.map(np.asarray, nnx.state(plain, nnx.Param))
  model, report = fp8jax.convert(plain, "O1")
  assert model is plain and isinstance(model.blocks[0].fc, fnnx.Linear)
  assert model.blocks[0].fc.kernel is kernel                 # the very same Variable
  assert isinstance(model.layers.qk, fnnx.Einsum) and type(model.head) is nnx.Linear
  _assert_trees_equal(nnx.state(model, nnx.Param), params_before)
  wired = NModel(fp8jax.Recipe(), rngs=nnx.Rngs(seed))
  _assert_trees_equal(nnx.state(model), nnx.state(wired))      # FP8 state included
  for (loss, grads, state), (loss_w, grads_w, state_w) in zip(_nnx_steps(model, tokens),
                                                              _nnx_steps(wired, tokens)):
    assert np.isfinite(loss)
    np.testing.assert_array_equal(loss, loss_w)
    _assert_trees_equal(grads, grads_w)
    _assert_trees_equal(state, state_w)
  hist = model.layers.fc.fp8_meta.get_value().output_grad.amax_history
  assert hist.shape == (2, 16) and np.all(hist[:, :2] > 0)    # per scanned layer, both steps
  assert set(report.converted) == {f"{b}/{g}" for b in ("blocks/0", "layers")
                                   for g in ("qk", "out", "fc")}
  assert (report["head"].reason, report["embed"].reason) == ("head", "embedding")
  assert report["layers/qk"].layers == 2


def test_nnx_takes_no_example_inputs_and_passes_amax_axes(key):
  with pytest.raises(ValueError, match="pass no example inputs"):
    fp8jax.convert(NModel(scanned=0, rngs=nnx.Rngs(0)), "O1", _tokens(key))
  model, _ = fp8jax.convert(NModel(scanned=0, rngs=nnx.Rngs(0)), "O1", amax_axes="data")
  assert model.blocks[0].fc.amax_axes == ("data",) and model.blocks[0].qk.amax_axes == ("data",)


# ---------------------------------------------------------------------- rules in the program

def _dots(lowered: str) -> list[tuple[bool, int]]:
  """(FP8 operands?, size of the result's last axis) of every dot_general in StableHLO."""
  out = []
  for line in lowered.splitlines():
    if "stablehlo.dot_general" in line:
      operands, result = line.rsplit(" : ", 1)[1].split(" -> ")
      dims = re.match(r"\s*tensor<((?:\d+x)+)\w+>", result).group(1)
      out.append((bool(re.search(r"xf8E[45]M[23]", operands)), int(dims.split("x")[-2])))
  return out


@pytest.fixture
def native_fp8(monkeypatch):
  """The FP8 GEMM path of GPUs with FP8 tensor cores: FP8 operands straight into dot_general."""
  monkeypatch.setattr(fdot, "native_fp8_reason", lambda: None)


def _check_program(dots, n_fp8, n_gemms):
  """The forward runs exactly n_fp8 FP8 GEMMs; the others, the LM head and attend (result
  width V) in BF16/F32."""
  assert len(dots) == n_gemms + 2
  assert sum(f8 for f8, _ in dots) == n_fp8
  assert [f8 for f8, n in dots if n == V] == [False, False]


LINEN_RULES = {"head": (ConvertRules(), ("blocks_0", "blocks_1", "blocks_2")),
               "first-last": (ConvertRules(keep_first_blocks=1, keep_last_blocks=1),
                              ("blocks_1",)),
               "path": (ConvertRules(keep=(r"blocks_[02]/.*",)), ("blocks_1",))}


@pytest.mark.parametrize("name", list(LINEN_RULES))
def test_linen_rules_decide_which_gemms_run_fp8(key, native_fp8, name):
  rules, fp8_blocks = LINEN_RULES[name]
  tokens = _tokens(key)
  model, report = fp8jax.convert(LModel(unrolled=3, scanned=0), "O1", tokens, rules=rules)
  variables = jax.eval_shape(model.init, key, tokens)
  lowered = jax.jit(model.apply).lower(variables, tokens).as_text()
  _check_program(_dots(lowered), 3 * len(fp8_blocks), 9)
  assert report.converted == tuple(f"{b}/{g}" for b in fp8_blocks
                                   for g in ("DenseGeneral_0", "Dense_0", "Einsum_0"))


NNX_RULES = {"head": (ConvertRules(), 9),
             "first-last": (ConvertRules(keep_first_blocks=1, keep_last_blocks=1), 3),
             "path": (ConvertRules(keep=(r".*/fc",)), 6)}


@pytest.mark.parametrize("name", list(NNX_RULES))
def test_nnx_rules_decide_which_gemms_run_fp8(key, native_fp8, name):
  rules, n_fp8 = NNX_RULES[name]
  model, report = fp8jax.convert(NModel(unrolled=3, scanned=0, rngs=nnx.Rngs(0)), "O1",
                                 rules=rules)
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
  _check_program(_dots(forward.lower(state, _tokens(key)).as_text()), n_fp8, 9)
  assert len(report.converted) == n_fp8
  if name == "first-last":
    assert {p.rsplit("/", 1)[0] for p in report.converted} == {"blocks/1"}


# ------------------------------------------------------------------------------ O0 and O1+

def test_o0_is_the_unconverted_model():
  plain = LModel()
  model, report = fp8jax.convert(plain, "O0", jax.ShapeDtypeStruct((B, T), jnp.int32))
  assert model is plain and not report.converted and report["head"].reason == "level O0"
  nplain = NModel(rngs=nnx.Rngs(0))
  nmodel, nreport = fp8jax.convert(nplain, fp8jax.O0)
  assert nmodel is nplain and not nreport.converted and len(nreport.entries) == 8
  assert not any(isinstance(m, (fnnx.Linear, fnnx.Einsum)) for _, m in nnx.iter_modules(nmodel))


def test_linen_fp8_ran_on_the_unconverted_params(key):
  """O1: loads the unconverted model's params; its error against the f32 model is above
  BF16's and bounded (FP8 GEMMs ran)."""
  k_init, k_tok = jax.random.split(key)
  tokens = _tokens(k_tok)
  plain = LModel(unrolled=2, scanned=0)
  params = jax.jit(plain.init)(k_init, tokens)["params"]
  model, _ = fp8jax.convert(plain, "O1", tokens)
  variables = jax.jit(model.init)(k_init, tokens)
  assert _spec(variables["params"]) == _spec(params)       # the parameters' tree unchanged
  out = jax.jit(model.apply)({**variables, "params": params}, tokens)
  ref = jax.jit(plain.clone(dtype=jnp.float32).apply)({"params": params}, tokens)
  bf16 = jax.jit(plain.apply)({"params": params}, tokens)
  err, err_bf16 = rel_err(out, ref), rel_err(bf16, ref)
  assert 3 * err_bf16 < err < 0.1, (err, err_bf16)


def test_nnx_fp8_ran_error_above_bf16_and_bounded(key):
  seed = int(jax.random.randint(key, (), 0, 1 << 30))
  tokens = _tokens(key)
  forward = nnx.jit(lambda m, t: m(t))
  bf16 = forward(NModel(scanned=0, rngs=nnx.Rngs(seed)), tokens)
  f32 = NModel(scanned=0, rngs=nnx.Rngs(seed))
  for _, m in nnx.iter_modules(f32):
    if isinstance(m, (nnx.Linear, nnx.Einsum)):
      m.dtype = jnp.float32
  ref = forward(f32, tokens)
  model, _ = fp8jax.convert(NModel(scanned=0, rngs=nnx.Rngs(seed)), fp8jax.O2)
  err, err_bf16 = rel_err(forward(model, tokens), ref), rel_err(bf16, ref)
  assert 3 * err_bf16 < err < 0.1, (err, err_bf16)
