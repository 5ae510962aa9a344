"""sft.launch: a rank that dies is one line naming it, with an exit status that tells how it ended."""

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from sft.launch import rank_failure


def failed(exitcode: int) -> ChildFailedError:
    return ChildFailedError("sft.spa_sft_trainer", {0: ProcessFailure(local_rank=0, pid=1, exitcode=exitcode,
                                                                      error_file="<N/A>")})


def test_a_rank_killed_for_memory_is_one_line_with_the_signal_status(capsys):
    assert rank_failure(failed(-9)) == 137
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: SFT rank 0 was killed by signal 9 (the kernel's out-of-memory killer? lower "
                   "data.max_tokens_per_micro_batch)"]


def test_a_rank_that_exits_with_an_error_keeps_its_status():
    assert rank_failure(failed(1)) == 1


def test_a_rank_that_printed_its_own_user_error_adds_no_line(capsys):
    assert rank_failure(failed(2)) == 2
    assert capsys.readouterr().err == ""
