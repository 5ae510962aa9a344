"""generator.decode_attention=split_kv_shared (shared_prefix_decode.py): the host's grouping of rows by the prefixes
their prompts share (known vectors), the tables it fills, and the decoder's plumbing on CPU with the kernel's
contract in torch in place of the Triton kernel (`generate`, and `generate_turn` with the reused prefix cache); the
setting's resolution. The kernels themselves: interpreted_split_kv.py under Triton's interpreter (run by
test_split_kv_decode.py) and, on a GPU, the tests named `gpu` below."""

from __future__ import annotations

import copy

import pytest
import torch

from SPA_agent.generators import SamplingParams, shared_prefix_decode, split_kv_decode
from SPA_agent.generators.hf import end_of_turn_ids, left_pad, pad_token_id
from SPA_agent.generators.prefix_cache import PrefixCachedDecoder, fed_tokens
from SPA_agent.generators.shared_prefix_decode import PrefixTables, common_prefix, shared_prefixes
from SPA_agent.generators.static_decode import masked_decode

SYSTEM = list(range(100, 164))  # 64 ids every prompt below starts with: the shortest prefix shared


def test_identical_prompts_share_every_id_in_one_group():
    prompt = SYSTEM + [7] * 36
    assert shared_prefixes([prompt, prompt, prompt]) == ([100, 100, 100], [[0, 1, 2]])


def test_prefixes_shorter_than_the_minimum_are_read_by_each_row():
    prompt = SYSTEM + [7] * 36
    assert shared_prefixes([prompt, SYSTEM[:63] + [1] * 37]) == ([0, 0], [])
    assert shared_prefixes([prompt, SYSTEM + [1] * 36]) == ([64, 64], [[1, 0]])  # [1] sorts first: the leader
    assert shared_prefixes([prompt]) == ([0], []) and shared_prefixes([]) == ([], [])


def test_each_member_shares_what_it_has_in_common_with_its_leader():
    """Sorted by ids the rows are 1, 0, 2; row 0 shares 150 ids with row 1 (the leader), row 2 100, and the leader
    reads the longest of its members' prefixes."""
    base = SYSTEM + list(range(136))  # 200 ids
    rows = [base[:150] + [1000], base, base[:100] + [2000]]
    assert shared_prefixes(rows) == ([150, 150, 100], [[1, 0, 2]])
    assert shared_prefixes([base, base + [5, 6]]) == ([200, 200], [[0, 1]])  # a prompt that another one extends


def test_rows_are_grouped_with_the_rows_they_share_most_with():
    """Two puzzles of three samples, all sharing a 64-id system prompt, at most 4 rows a group: one group a puzzle
    (2 × 2 × 264 keys not read again), not 4 + 2 rows across puzzles (3 × 64 + 264)."""
    first, second = SYSTEM + [1] * 200, SYSTEM + [2] * 200
    shared, groups = shared_prefixes([first, second, first, second, first, second], members=4)
    assert groups == [[0, 2, 4], [1, 3, 5]] and shared == [264] * 6


def test_more_repeats_than_a_group_holds_make_several_groups():
    shared, groups = shared_prefixes([SYSTEM] * 10, members=8)
    assert sorted(row for group in groups for row in group) == list(range(10)) and shared == [64] * 10
    assert len(groups) == 2 and all(2 <= len(group) <= 8 for group in groups)


def test_common_prefix_across_and_inside_blocks():
    first = list(range(200))
    assert common_prefix(first, first) == 200 and common_prefix(first, first[:130]) == 130
    assert common_prefix(first, first[:128] + [-1] + first[129:]) == 128  # a block's first id
    assert common_prefix(first, first[:67] + [-1], block=4) == 67 and common_prefix([], first) == 0


def test_tables_hold_the_groups_and_nothing_past_the_calls_rows():
    tables = PrefixTables(5, torch.device("cpu"))
    tables.fill([100, 100, 0], [[1, 0]])
    assert tables.shared_lengths.tolist() == [100, 100, 0, 0, 0]
    assert tables.groups.tolist() == [[1, 0] + [-1] * 6, [-1] * 8]  # 5 // 2 groups of at most MEMBERS rows


def leader_read_decode(query, key, value, kv_lengths, tables, scaling=None):
    """shared_prefix_decode's contract in torch: row b reads its first min(shared_lengths[b], kv_lengths[b] - 1)
    keys and values from its group's leader's row, the rest of its first kv_lengths[b] from its own."""
    shared_lengths, groups = tables
    leaders = torch.arange(key.shape[0])
    for members in ([row for row in group if row >= 0] for group in groups.tolist()):
        leaders[members] = members[0] if members else 0
    grouped = {row for group in groups.tolist() for row in group if row >= 0}
    assert set(shared_lengths.nonzero()[:, 0].tolist()) <= grouped  # every row with a shared prefix is in a group
    prefix = torch.minimum(shared_lengths, kv_lengths - 1)
    from_leader = (torch.arange(key.shape[1]) < prefix[:, None])[..., None, None]  # (B, L, 1, 1)
    key, value = (torch.where(from_leader, t[leaders], t) for t in (key, value))
    return masked_decode(query, key, value, kv_lengths, scaling)


@pytest.fixture
def leader_reads(monkeypatch):
    """The shared-prefix kernel replaced by its contract in torch (`leader_read_decode`), which runs on CPU; the
    fills of every decode state's tables recorded (the list returned)."""
    monkeypatch.setattr(shared_prefix_decode, "shared_prefix_decode", leader_read_decode)
    fills, fill = [], PrefixTables.fill
    monkeypatch.setattr(PrefixTables, "fill", lambda self, shared, groups: (fills.append((shared, groups)),
                                                                             fill(self, shared, groups))[1])
    return fills


GRID = "######\n#O####\n#XP###\n#__###\n######\n"
#: user texts in groups: three identical (the tiny model ends their turn after 13 greedy tokens), one sharing all but
#: its last ids with them, two identical longer ones, one short alone
GROUPED = [GRID * 4 + "You", "Short", GRID * 4 + "You", GRID * 6, GRID * 4 + "Up", GRID * 4 + "You", GRID * 6]


def grouped_ids(make_prompt) -> list[list[int]]:
    return [make_prompt(text).prompt_ids for text in GROUPED]


def decoder(model, tokenizer, attention, **settings) -> PrefixCachedDecoder:
    stop_ids = end_of_turn_ids(model, tokenizer)
    return PrefixCachedDecoder(model, stop_ids, pad_token_id(tokenizer, stop_ids), attention=attention, **settings)


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
SHORTER = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.mark.parametrize("keep_graphs", [False, True], ids=["own_state", "kept_state_of_16_rows"])
def test_decoder_reading_shared_prefixes_from_leaders_samples_what_it_samples_without(
        varied_model, tiny_tokenizer, make_prompt, leader_reads, keep_graphs):
    """Greedy tokens as the masked attention's (float32), some turns ending early (their rows read one key after);
    the identical prompts prefilled once (their keys copied to the repeats' rows), the groups those of
    `shared_prefixes` of the decode batch's rows, the padding rows of a kept state sharing nothing."""
    prompts = grouped_ids(make_prompt)
    decoders = {attention: decoder(varied_model, tiny_tokenizer, attention, keep_graphs=keep_graphs)
                for attention in ("flash", "split_kv_shared")}
    input_ids, attention_mask = left_pad(prompts, decoders["flash"].pad_id, torch.device("cpu"))
    with torch.inference_mode():
        tokens = {attention: run.generate(input_ids, attention_mask, GREEDY, torch.Generator()).tolist()
                  for attention, run in decoders.items()}
    assert tokens["split_kv_shared"] == tokens["flash"]
    stop_ids = set(end_of_turn_ids(varied_model, tiny_tokenizer))
    assert any(stop_ids & set(ids[:-1]) for ids in tokens["flash"])
    shared = decoders["split_kv_shared"]
    assert shared.stats.copied_tokens == 2 * len(prompts[0]) + len(prompts[3])
    assert shared.stats.prefill_tokens < decoders["flash"].stats.prefill_tokens
    assert leader_reads == [shared_prefixes(prompts)] and leader_reads[0][1]
    state = next(iter(shared._states.values()))
    assert state.prefixes.shared_lengths.tolist()[len(prompts):] == [0] * (state.shape[0] - len(prompts))


def test_turns_with_the_reused_prefix_cache_share_their_first_prompts(varied_model, tiny_tokenizer, make_prompt,
                                                                     leader_reads):
    """generate_turn, two turns, kept graphs and the reused cache: the second turn's prompts (each chat's first
    prompt, its first fed tokens, a new id: short enough for the buffer, so each is prefilled past what its row
    holds) share their common prefixes; greedy turns are those of the masked attention."""
    first = grouped_ids(make_prompt)
    chats = list(range(len(first)))
    stop_ids = set(end_of_turn_ids(varied_model, tiny_tokenizer))
    turns = {}
    for attention in ("flash", "split_kv_shared"):
        run = decoder(varied_model, tiny_tokenizer, attention, keep_graphs=True, reuse_prefix_cache=True)
        with torch.inference_mode():
            sampled = run.generate_turn(first, chats, GREEDY, torch.Generator())
            second = [ids + fed_tokens(turn, stop_ids)[:4] + [5] for ids, turn in zip(first, sampled)]
            turns[attention] = (sampled, run.generate_turn(second, chats, SHORTER, torch.Generator()))
        assert run.stats.reused_tokens > 0
    assert turns["split_kv_shared"] == turns["flash"]
    assert leader_reads == [shared_prefixes(first), shared_prefixes(second)] and leader_reads[1][1]


def test_pipelined_turns_share_nothing_in_decode_but_prefill_identical_prompts_once(varied_model, tiny_tokenizer,
                                                                                     make_prompt, leader_reads):
    """PipelinedDecoder.serve (rows' prompts change mid-call): no tables filled, so the kernel reads every row's own
    keys, as split_kv; identical prompts prefilled once. Two greedy turns a row, as the masked attention's."""
    from SPA_agent.generators.turn_pipeline import PipelinedDecoder

    stop_ids = end_of_turn_ids(varied_model, tiny_tokenizer)
    first, turns = grouped_ids(make_prompt), {}
    for attention in ("flash", "split_kv_shared"):
        run = PipelinedDecoder(varied_model, stop_ids, pad_token_id(tiny_tokenizer, stop_ids), attention=attention)
        sampled = turns[attention] = [[] for _ in first]

        def respond(row: int, ids: list[int], sampled=sampled) -> list[int] | None:
            sampled[row].append(ids)
            return first[row] + ids + [5] if len(sampled[row]) == 1 else None  # a second turn, then done

        with torch.inference_mode():
            run.serve(list(first), GREEDY, torch.Generator(), respond)
    assert turns["split_kv_shared"] == turns["flash"] and all(len(row) == 2 for row in turns["flash"])
    # the first prompts' repeats copied, then those of their second prompts (identical rows, identical greedy turns)
    assert leader_reads == [] and run.stats.copied_tokens > 2 * len(first[0]) + len(first[3])


def test_the_setting_resolves_where_triton_runs_and_passes_the_config_checks():
    from SPA_agent.config import compose
    from SPA_agent.trainer.config_checks import check_config

    check_config(compose("_2_sokoban", ["model=tiny", "generator.decode_attention=split_kv_shared"]))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="decode_attention=split_kv_shared needs triton and a CUDA GPU; set"):
            split_kv_decode.resolve("split_kv_shared", torch.device("cpu"))


needs_gpu = pytest.mark.skipif(not (torch.cuda.is_available() and split_kv_decode.available()),
                               reason="the compiled Triton kernels need a CUDA GPU and triton")


def ppo_batch_inputs(dtype):
    """SmolLM2's heads at a PPO turn's shape: 256 rows in 32 groups of 8 sharing a 556-key prompt (written into each
    member's row as well), rows decoded 1 to 600 tokens past it, a quarter finished."""
    from interpreted_split_kv import decode_inputs

    query, key, value, _ = decode_inputs(256, 9, 3, 64, 1216, device="cuda")
    groups = [list(range(start, start + 8)) for start in range(0, 256, 8)]
    for group in groups:
        key[group, :556], value[group, :556] = key[group[0], :556], value[group[0], :556]
    gen = torch.Generator().manual_seed(3)
    kv_lengths = torch.randint(557, 1157, (256,), generator=gen, dtype=torch.int32)
    kv_lengths[torch.randperm(256, generator=gen)[:64]] = 1
    tables = PrefixTables(256, torch.device("cuda"))
    tables.fill([556] * 256, groups)
    return query.to(dtype), key.to(dtype), value.to(dtype), kv_lengths.cuda(), tables.tensors


@needs_gpu
@pytest.mark.parametrize("launch", [{}, dict(max_splits=2), dict(split=128, block_n=32, num_warps=2, num_stages=2)],
                         ids=["defaults", "capped_at_2", "s128_b32_w2_st2"])
def test_shared_kernel_on_gpu_equals_the_masked_reference(launch):
    """bfloat16 (the GPU's decode dtype): the tolerance of split_kv's GPU test; the interpreter's cases too; at the
    decoder's launch parameters and others (benchmarks/decode_attention_kernels.py's)."""
    from interpreted_split_kv import SHARED_CASES, shared_inputs

    cases = [ppo_batch_inputs(torch.bfloat16)] + [shared_inputs(*case) for case in SHARED_CASES.values()]
    for query, key, value, kv_lengths, tables in cases:
        query, key, value = (t.to("cuda", torch.bfloat16) for t in (query, key, value))
        kv_lengths, tables = kv_lengths.cuda(), tuple(t.cuda() for t in tables)
        output = shared_prefix_decode.shared_prefix_decode(query, key, value, kv_lengths, tables, scaling=0.125,
                                                           **launch)
        reference = masked_decode(query.float(), key.float(), value.float(), kv_lengths, scaling=0.125)
        torch.testing.assert_close(output.float(), reference, atol=2e-2, rtol=0)


@needs_gpu
@pytest.mark.parametrize("keep_graphs", [False, True])
def test_cuda_graph_decoder_with_shared_prefixes_on_gpu_samples_what_split_kv_samples(
        varied_model, tiny_tokenizer, make_prompt, keep_graphs):
    """float32 on the GPU (IEEE float32 products), every decode step a CUDA-graph replay: split_kv_shared's greedy
    tokens and finish reasons are split_kv's."""
    from interpreted_split_kv import generations

    from SPA_agent.generators.hf import HFGenerator

    model = copy.deepcopy(varied_model).to("cuda")
    prompts = [make_prompt(text) for text in GROUPED] * 2
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    if not keep_graphs:
        assert (generations(model, tiny_tokenizer, prompts, greedy, "split_kv_shared")
                == generations(model, tiny_tokenizer, prompts, greedy, "split_kv"))
        return
    runs = [HFGenerator(model, tiny_tokenizer, greedy, batch_size=None, decoder="static", progress=False,
                        decode_attention=attention, keep_decode_graphs=True)
            for attention in ("split_kv", "split_kv_shared")]
    for batch in (prompts, prompts[::-1]):  # the second call replays the first call's graph, its groups in other rows
        assert [g.token_ids for g in runs[1].generate(batch)] == [g.token_ids for g in runs[0].generate(batch)]


def test_smollm2_decodes_with_shared_prefixes_and_fused_projections_and_other_models_do_not(varied_model,
                                                                                             tiny_tokenizer):
    """model=smollm2-135m's rollout settings reach the generator (the lease-6 gate's fastest decode on an H200) and
    still build a generator on a CPU; the generator's own keys override them; other presets keep the plain defaults."""
    from SPA_agent.config import compose
    from SPA_agent.generators.hf import HFGenerator

    smol = compose("_2_sokoban", ["model=smollm2-135m"]).generator
    assert (smol.decode_attention, smol.fused_projections) == ("auto_shared", "auto")
    generator = HFGenerator.from_config({**smol, "decoder": "static", "progress": False}, "tiny", tiny_tokenizer,
                                        model=varied_model)
    assert (generator.decode_attention, generator.fused_projections) == ("flash", False)  # on a CPU
    for preset in ("tiny", "small", "qwen2.5-0.5b"):
        cfg = compose("_2_sokoban", [f"model={preset}"]).generator
        assert (cfg.decode_attention, cfg.fused_projections) == ("auto", False)
    cfg = compose("_2_sokoban", ["model=smollm2-135m", "generator.decode_attention=flash",
                                 "generator.fused_projections=false"]).generator
    assert (cfg.decode_attention, cfg.fused_projections) == ("flash", False)
