"""Trace readers, synthetic workloads and deterministic prompt ids (bench/traces.py)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from shepherd.bench.records import TraceRequest
from shepherd.bench import synthetic as S
from shepherd.bench import trace_formats as F
from shepherd.bench import traces as T
from shepherd.paths import data_path

DATA = Path(__file__).parent / "data"


def test_azure_fixture():
    reqs = T.load_trace(DATA / "azure_conv_20.csv")
    assert F.detect_format(DATA / "azure_conv_20.csv") == "azure"
    assert len(reqs) == 20
    assert reqs[0].arrival == 0.0 and (reqs[0].prompt_tokens, reqs[0].output_tokens) == (374, 44)
    # 18:15:50.9951690 - 18:15:46.6805900
    assert reqs[1].arrival == pytest.approx(4.314579, abs=1e-5)
    assert all(a.arrival <= b.arrival for a, b in zip(reqs, reqs[1:]))
    assert [r.index for r in reqs] == list(range(20))


def test_servegen_fixture_clients():
    reqs = T.load_trace(DATA / "servegen_19.csv")
    assert len(reqs) == 19
    assert reqs[0].client == "client-20"
    assert len({r.client for r in reqs}) > 1


def test_limit_time_scale_rate():
    a = T.load_trace(DATA / "azure_conv_20.csv", limit=5)
    assert len(a) == 5
    b = T.load_trace(DATA / "azure_conv_20.csv", limit=5, time_scale=0.5)
    assert [x.arrival for x in b] == pytest.approx([x.arrival * 0.5 for x in a])
    c = T.load_trace(DATA / "azure_conv_20.csv", rate=4.0)
    assert (len(c) - 1) / c[-1].arrival == pytest.approx(4.0)


@pytest.mark.parametrize("fmt,header,good,bad,msg", [
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.68,374,44",
     "2023-11-16 18:15:47.00,abc,44", "ContextTokens"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.68,374,44",
     "yesterday,374,44", "TIMESTAMP"),
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.68,374,44",
     "2023-11-16 18:15:47.00,374", "expected 3 fields"),
    ("servegen", "timestamp_s,client_id,input_tokens,output_tokens", "0.5,3,100,20",
     "0.7,3,-5,20", "input_tokens"),
    ("servegen", "timestamp_s,client_id,input_tokens,output_tokens", "0.5,3,100,20",
     "nan,3,100,20", "timestamp_s"),
    # an impossible clock ran on into the next day (month 13 was already refused)
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.68,374,44",
     "2023-11-16 25:99:99,374,44", "TIMESTAMP"),
    # a 1e12-token prompt ran the machine out of memory building it
    ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46.68,374,44",
     "2023-11-16 18:15:47.00,1000000000000,44", "ContextTokens must be <= 10,000,000"),
])
def test_csv_readers_reject_malformed_rows_with_line_number(tmp_path, fmt, header, good, bad, msg):
    p = tmp_path / "t.csv"
    p.write_text("\n".join([header, good, good, bad, good]) + "\n")
    with pytest.raises(F.TraceFormatError) as e:
        T.load_trace(p, fmt)
    assert f"{p}:4:" in str(e.value) and msg in str(e.value)


def test_csv_reader_rejects_missing_column(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,374\n")
    with pytest.raises(F.TraceFormatError, match=r":1: header lacks"):
        list(F.iter_file(p, "azure"))


@pytest.mark.parametrize("name,text", [
    ("az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n"),
    ("sg.csv", "timestamp_s,client_id,input_tokens,output_tokens\n0.5,3,100,20\n"),
    ("mc.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'),
])
def test_readers_take_a_file_saved_with_a_utf8_bom_and_crlf(tmp_path, name, text):
    # a trace saved by a spreadsheet or a Windows editor starts with a byte-order mark and ends
    # its lines with CRLF; its header must still be found, its format still told from it
    p = tmp_path / name
    p.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    (r,) = T.load_trace(p)
    assert r.prompt_tokens in (374, 100, 600)


@pytest.mark.parametrize("bad,msg", [
    ("{not json", "not valid JSON"),
    ('{"timestamp": 5, "input_length": 100}', "output_length"),
    ('{"timestamp": 5, "input_length": "x", "output_length": 3}', "input_length"),
    ('{"timestamp": 5, "input_length": 100, "output_length": 3, "hash_ids": [1, "a"]}', "hash_ids"),
    ('{"timestamp": 5, "input_length": 5000, "output_length": 3, "hash_ids": [1]}', "hash_ids cover"),
])
def test_mooncake_rejects_malformed_rows_with_line_number(tmp_path, bad, msg):
    p = tmp_path / "t.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]})
    p.write_text("\n".join([good, good, bad]) + "\n")
    with pytest.raises(F.TraceFormatError) as e:
        list(F.iter_file(p, "mooncake"))
    assert f"{p}:3:" in str(e.value) and msg in str(e.value)


def test_mooncake_prompt_ids_share_blocks():
    reqs = T.load_trace(DATA / "mooncake_5.jsonl")
    assert [r.arrival for r in reqs] == pytest.approx([0, 0.1, 0.2, 0.3, 0.4])
    ids = [T.prompt_token_ids(r, 32000) for r in reqs]
    assert [len(x) for x in ids] == [r.prompt_tokens for r in reqs]
    assert ids[0][:1024] == ids[1][:1024]           # blocks 0, 1 shared
    assert ids[0][1024:1100] != ids[1][1024:1100]   # block 2 vs 3
    assert ids[2][:1500] == ids[0][:1500]           # blocks 0, 1, 2
    assert ids[3][:512] == ids[4][:512] and ids[3][512:600] != ids[4][512:600]
    assert all(256 <= t < 32000 for x in ids for t in x)
    # deterministic across calls
    assert T.prompt_token_ids(reqs[2], 32000) == ids[2]


def test_unique_prompts_differ_and_are_deterministic():
    a = TraceRequest(arrival=0, prompt_tokens=50, output_tokens=5, index=1)
    b = TraceRequest(arrival=0, prompt_tokens=50, output_tokens=5, index=2)
    assert T.prompt_token_ids(a, 1000) == T.prompt_token_ids(a, 1000)
    assert T.prompt_token_ids(a, 1000) != T.prompt_token_ids(b, 1000)


def test_synthetic_clients_rates_prefix_and_sessions():
    spec = S.SyntheticSpec(clients=[
        S.ClientSpec("a", rate=2.0, input_len="fixed:100", output_len="fixed:10", system_prompt_tokens=50),
        S.ClientSpec("b", rate=4.0, input_len="uniform:10:20", output_len="fixed:5", arrival="gamma", cv=2.0,
                     turns=3, think_time=1.0, system_prompt_tokens=30),
    ], duration=200.0, seed=7)
    reqs = S.synthetic(spec)
    assert reqs == S.synthetic(spec)                       # deterministic
    a = [r for r in reqs if r.client == "a"]
    assert 300 < len(a) < 500                              # ~2 req/s over 200 s
    assert all(r.prompt_tokens == 150 for r in a)
    ia, ib = T.prompt_token_ids(a[0], 5000), T.prompt_token_ids(a[1], 5000)
    assert ia[:50] == ib[:50] and ia[50:] != ib[50:]       # shared system prompt
    sess = {}
    for r in reqs:
        if r.client == "b":
            sess.setdefault(r.session, []).append(r)
    turns = next(v for v in sess.values() if len(v) == 3)
    p0, p1 = T.prompt_token_ids(turns[0], 5000), T.prompt_token_ids(turns[1], 5000)
    assert len(p1) > len(p0) and p1[:len(p0)] == p0        # turn 2 extends turn 1
    assert turns[1].arrival >= turns[0].arrival
    other = next(v for k, v in sess.items() if v[0] is not turns[0])
    q0 = T.prompt_token_ids(other[0], 5000)
    assert q0[:30] == p0[:30] and q0[30:40] != p0[30:40]   # sessions share the system prompt only


def test_parse_clients():
    cs = S.parse_clients("x=1.5,y=3")
    assert [(c.name, c.rate) for c in cs] == [("x", 1.5), ("y", 3.0)]
    assert len(S.parse_clients("4@0.5")) == 4


def test_real_traces_slices():
    """The traces shepherd ships (shepherd/data) read as what they are."""
    az = T.load_trace(data_path("azure_llm_2023", "AzureLLMInferenceTrace_conv.csv"), limit=200)
    mc = T.load_trace(data_path("mooncake", "synthetic_trace.jsonl"), limit=50)
    sg = T.load_trace(data_path("servegen", "servegen_m-large_1h_multitenant_sample.csv"), limit=300)
    assert len(az) == 200 and len(mc) == 50 and len(sg) == 300
    assert all(r.hash_ids for r in mc)
    assert len({r.client for r in sg}) > 3


def test_readers_are_lazy_and_repeat_shifts_copies(tmp_path):
    p = tmp_path / "t.csv"
    rows = [f"2023-11-16 18:15:{10 + i:02d}.0,{100 + i},5" for i in range(6)]
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    it = T.iter_trace(p)
    assert next(it).arrival == 0.0          # a generator: nothing is read ahead of need beyond the window
    reqs = list(T.iter_trace(p, repeat=3))
    assert len(reqs) == 18
    assert [r.index for r in reqs] == list(range(18))
    # copy k starts one span plus one mean gap (5 s + 1 s) after copy k-1
    assert [r.arrival for r in reqs[5:8]] == pytest.approx([5.0, 6.0, 7.0])
    assert all(a.arrival < b.arrival for a, b in zip(reqs, reqs[1:]))


def test_reader_rejects_a_trace_that_goes_back_in_time(tmp_path, monkeypatch):
    monkeypatch.setattr(F, "REORDER_WINDOW", 2)
    p = tmp_path / "t.csv"
    times = [10, 11, 12, 13, 14, 1]
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 + "\n".join(f"2023-11-16 18:15:{t:02d}.0,100,5" for t in times) + "\n")
    with pytest.raises(F.TraceFormatError, match="back in time"):
        list(T.iter_trace(p))
    # local disorder within the window is sorted out
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 + "\n".join(f"2023-11-16 18:15:{t:02d}.0,{t},5" for t in [10, 12, 11, 13]) + "\n")
    assert [r.prompt_tokens for r in T.iter_trace(p)] == [10, 11, 12, 13]


def test_diurnal_rate_follows_the_day():
    spec = S.SyntheticSpec(clients=[S.ClientSpec("a", rate=0.05, diurnal=0.9)], duration=86400.0, seed=2)
    reqs = S.synthetic(spec)
    night = sum(1 for r in reqs if r.arrival < 3 * 3600 or r.arrival >= 21 * 3600)
    noon = sum(1 for r in reqs if 9 * 3600 <= r.arrival < 15 * 3600)
    assert noon > 3 * night
    assert abs(len(reqs) / 86400.0 - 0.05) < 0.01


def test_azure_2024_timestamps_with_a_utc_offset_and_mixed_precision(tmp_path):
    # the 2024 week-long files write "2024-05-10 00:00:00.009930+00:00", and drop the fraction on a
    # whole second; an offset other than +00:00 is converted, so arrivals stay in one time line
    p = tmp_path / "week.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2024-05-10 00:00:00.009930+00:00,2000,20\n"
                 "2024-05-10 00:00:01+00:00,300,0\n"
                 "2024-05-10 02:00:02.5000000+02:00,40,7\n"
                 "2024-05-10T00:00:03Z,50,8\n")
    reqs = T.load_trace(p)
    assert [r.arrival for r in reqs] == pytest.approx([0.0, 0.99007, 2.49007, 2.99007], abs=1e-5)
    assert [r.output_tokens for r in reqs] == [20, 1, 7, 8]     # a prefill-only request keeps 1 output token
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:01+0x:00,300,5\n")
    with pytest.raises(F.TraceFormatError, match=":2: TIMESTAMP"):
        T.load_trace(p)


BURST6 = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
BURST8 = "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def test_burstgpt_both_layouts_model_as_client_failures_and_empty_prompts(tmp_path):
    # hand-written rows in the real schema: the 6 columns of BurstGPT_1/_2 and the 8 of BurstGPT_3,
    # whose Session ID and Elapsed time sit BEFORE Model (a reader by position would misread them)
    p6 = tmp_path / "b1.csv"
    p6.write_text(BURST6 + "5.0,ChatGPT,472,18,490,Conversation log\n"
                  "7.0,GPT-4,0,0,0,API log\n"                       # nothing to prefill: skipped
                  "9.5,GPT-4,417,0,417,API log\n"                   # a failure: kept, 1 output token
                  "\n"
                  "12.0,ChatGPT,1087,230,1317,Conversation log\n")
    p8 = tmp_path / "b3.csv"
    p8.write_text(BURST8 + "19440110.0,1722ac82,43,GPT-4,906,446,1352,Conversation log\n"
                  "19440161.0,,2,ChatGPT,36,29,65,API log\n")
    assert F.detect_format(p6) == F.detect_format(p8) == "burstgpt"
    a = T.load_trace(p6)
    assert [(r.arrival, r.client, r.prompt_tokens, r.output_tokens) for r in a] == [
        (0.0, "ChatGPT", 472, 18), (4.5, "GPT-4", 417, 1), (7.0, "ChatGPT", 1087, 230)]
    assert [r.index for r in a] == [0, 1, 2]
    b = T.load_trace(p8)
    assert [(r.arrival, r.client, r.prompt_tokens, r.output_tokens) for r in b] == [
        (0.0, "GPT-4", 906, 446), (51.0, "ChatGPT", 36, 29)]
    assert "burstgpt" in F.FORMATS


def test_burstgpt_says_how_many_empty_prompts_it_skipped(tmp_path, caplog):
    p = tmp_path / "b1.csv"
    p.write_text(BURST6 + "5.0,ChatGPT,472,18,490,Conversation log\n7.0,GPT-4,0,0,0,API log\n"
                 "8.0,GPT-4,0,12,12,API log\n9.5,GPT-4,417,0,417,API log\n")
    with caplog.at_level("WARNING", logger="shepherd.bench.trace_formats"):
        assert len(T.load_trace(p)) == 2
    assert f"{p}: skipped 2 row(s) with 0 Request tokens" in caplog.text


@pytest.mark.parametrize("bad,msg", [
    ("6.0,ChatGPT,-3,5,2,API log", "Request tokens"),
    ("6.0,,30,5,35,API log", "Model"),
    ("x,ChatGPT,30,5,35,API log", "Timestamp"),
])
def test_burstgpt_rejects_malformed_rows_with_line_number(tmp_path, bad, msg):
    p = tmp_path / "b.csv"
    p.write_text(BURST6 + "5.0,ChatGPT,472,18,490,Conversation log\n" + bad + "\n")
    with pytest.raises(F.TraceFormatError) as e:
        T.load_trace(p)
    assert f"{p}:3:" in str(e.value) and msg in str(e.value)


def test_servegen_published_rate_file_is_named_for_what_it_is(tmp_path):
    # ServeGen publishes per-client windows (chunk-N-trace.csv: time, rate, cv, pattern, 2 args; no
    # header), not requests: the error says so instead of 'cannot tell the format'
    p = tmp_path / "chunk-10-trace.csv"
    p.write_text("0,0,0,,0,0\n1200,0.0233,1.13,Gamma,0.778,48.77\n")
    with pytest.raises(F.TraceFormatError, match="ServeGen's per-client rate file"):
        T.load_trace(p)


@pytest.mark.parametrize("name,text", [
    ("b.csv.gz", BURST6 + "5.0,ChatGPT,472,18,490,Conversation log\n9.5,GPT-4,417,3,420,API log\n"),
    ("m.jsonl.gz", '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n'
                   '{"timestamp": 4500, "input_length": 700, "output_length": 5, "hash_ids": [1, 3]}\n'),
    ("a.csv.gz", "TIMESTAMP,ContextTokens,GeneratedTokens\r\n2024-05-10 00:00:00.5+00:00,374,44\r\n"
                 "2024-05-10 00:00:05+00:00,100,4\r\n"),
])
def test_readers_stream_a_gzipped_trace(tmp_path, name, text):
    # week- and month-long traces are kept compressed: FILE.csv.gz / FILE.jsonl.gz read as the file
    import gzip
    p = tmp_path / name
    with gzip.open(p, "wt") as f:
        f.write(text)
    plain = tmp_path / name.removesuffix(".gz")
    plain.write_text(text)
    assert F.detect_format(p) == F.detect_format(plain)
    got, want = T.load_trace(p), T.load_trace(plain)
    assert [(r.arrival, r.prompt_tokens, r.output_tokens, r.client) for r in got] == \
           [(r.arrival, r.prompt_tokens, r.output_tokens, r.client) for r in want]
    assert len(got) == 2 and got[1].arrival > 0


def test_vidur_trace_with_and_without_arrivals(tmp_path):
    # microsoft/vidur's processed traces: arrived_at (s) + lengths for replay, or lengths alone
    p = tmp_path / "splitwise_conv.csv"
    p.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\n4.3,396,0\n")
    assert F.detect_format(p) == "vidur"
    assert [(r.arrival, r.prompt_tokens, r.output_tokens) for r in T.load_trace(p)] == [(0.0, 374, 44), (4.3, 396, 1)]
    q = tmp_path / "lengths.csv"
    q.write_text("num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n3772,54,3826,69.8\n120,7,127,17.1\n")
    assert [(r.arrival, r.prompt_tokens) for r in T.load_trace(q)] == [(0.0, 3772), (0.0, 120)]
    # as a length source for synthetic arrivals
    spec = S.SyntheticSpec(clients=[S.ClientSpec("a", rate=2.0, input_len=f"trace:{q}", output_len=f"trace:{q}")],
                           num_requests=20, seed=1)
    reqs = S.synthetic(spec)
    assert {r.prompt_tokens for r in reqs} <= {3772, 120} and reqs[-1].arrival > 0


def test_azure_2025_multimodal_trace_reads_as_azure(tmp_path):
    # AzureLMMInferenceTrace_multimodal.csv.gz (2025): ISO 'T...Z' times and a NumImages column
    # (not read: requests are text of ContextTokens tokens), kept gzipped as published
    import gzip
    p = tmp_path / "AzureLMMInferenceTrace_multimodal.csv.gz"
    with gzip.open(p, "wt") as f:
        f.write("TIMESTAMP,NumImages,ContextTokens,GeneratedTokens\n"
                "2024-10-15T12:00:00.269Z,0,770,491\n2024-10-15T12:00:05.819Z,1,949,126\n")
    assert F.detect_format(p) == "azure"
    assert [(r.arrival, r.prompt_tokens, r.output_tokens) for r in T.load_trace(p)] == \
           [(0.0, 770, 491), (pytest.approx(5.55, abs=1e-5), 949, 126)]


def test_ragpulse_seconds_not_milliseconds(tmp_path):
    # flashserve/RAGPulse's 0_trace.jsonl: Mooncake's field names, timestamp in seconds as a string,
    # hash_ids a map of the prompt's parts: told apart from Mooncake by that map, and read in seconds
    p = tmp_path / "0_trace.jsonl"
    rows = [{"timestamp": "82", "input_length": 3112, "output_length": 192, "session_id": "s1",
             "hash_ids": {"sys_prompt": [8302, 14332], "passages_ids": [7398], "history": [15200],
                          "web_search": [], "user_input": [26923]}},
            {"timestamp": "93", "input_length": 3167, "output_length": 0, "session_id": "s2",
             "hash_ids": {"sys_prompt": [8302], "passages_ids": [], "history": [], "web_search": [],
                          "user_input": [26922]}}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert F.detect_format(p) == "ragpulse"
    assert [(r.arrival, r.prompt_tokens, r.output_tokens, r.hash_ids) for r in T.load_trace(p)] == [
        (0.0, 3112, 192, None), (11.0, 3167, 1, None)]
    assert F.detect_format(DATA / "mooncake_5.jsonl") == "mooncake"


def test_ragpulse_chunks_from_its_side_files_share_prefixes(tmp_path, caplog):
    # with the release's side files beside the trace, hash_ids become the prompt's chunks in order:
    # two prompts share tokens as far as their leading chunk ids agree
    rows = [{"timestamp": "0", "input_length": 530, "output_length": 5,
             "hash_ids": {"sys_prompt": [1, 2], "passages_ids": [7], "history": [], "web_search": [],
                          "user_input": [9]}},
            {"timestamp": "5", "input_length": 528, "output_length": 5,
             "hash_ids": {"sys_prompt": [1, 3], "passages_ids": [7], "history": [], "web_search": [],
                          "user_input": [10]}}]
    (tmp_path / "0_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING", logger="shepherd.bench.trace_formats"):
        assert all(r.chunks is None for r in T.load_trace(tmp_path / "0_trace.jsonl"))
    assert "none of RAGPulse's side files" in caplog.text
    sides = {"1_sys_prompt.jsonl": [("sys_prompt_id", 1, 256), ("sys_prompt_id", 2, 200), ("sys_prompt_id", 3, 198)],
             "2_passages.jsonl": [("passage_id", 7, 60)], "3_history.jsonl": [],
             "4_user_input.jsonl": [("user_input_id", 9, 8), ("user_input_id", 10, 8)], "5_web_search.jsonl": []}
    for name, items in sides.items():
        (tmp_path / name).write_text("".join(json.dumps({k: i, "token_length": n}) + "\n\n" for k, i, n in items))
    a, b = T.load_trace(tmp_path / "0_trace.jsonl")
    assert a.chunks == [(1, 256), (2, 200), (7, 60), (9, 8)] and b.chunks[:2] == [(1, 256), (3, 198)]
    ia, ib = T.prompt_token_ids(a, 32000), T.prompt_token_ids(b, 32000)
    assert (len(ia), len(ib)) == (530, 528)
    assert ia[:256] == ib[:256] and ia[256:456] != ib[256:454]


@pytest.mark.parametrize("name,body,msg", [
    ("t.csv.gz", b"TIMESTAMP,ContextTokens,GeneratedTokens\n", "named .gz but not gzip-compressed"),
    ("t.csv", b"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,3\xff4,44\n", "not UTF-8 text"),
    ("t.json", b"[1, 2]", "a synthetic spec is a JSON object"),
    (".", None, "is a folder, not a trace file"),
])
def test_unreadable_trace_files_are_one_error_that_names_the_file(tmp_path, name, body, msg):
    # were gzip.BadGzipFile, UnicodeDecodeError, AttributeError, IsADirectoryError
    p = tmp_path / name
    if body is not None:
        p.write_bytes(body)
    with pytest.raises(F.TraceFormatError) as e:
        T.load_trace(p)
    assert str(e.value).startswith(str(p)) and msg in str(e.value)


@pytest.mark.parametrize("spec", ["fixed:1000000000000", "uniform:5:1", "fixed:0", "zipf:1:100000000000"])
def test_length_distributions_out_of_range_are_refused(spec):
    with pytest.raises(ValueError, match="bad length distribution"):
        S.LengthDist(spec).sampler(random.Random(0))
