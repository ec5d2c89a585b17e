import sys, dataclasses
from megatron_ext.testing import tiny_llama
from megatron_ext.testing.multirank import run_on_ranks
from megatron_ext.testing.receiver_proc import start_hf_receiver
from . import test_export_multirank as T

def body(a, b):
    import faulthandler; f = open("/tmp/wx/fh.txt", "w"); faulthandler.dump_traceback_later(60, exit=True, file=f)
    return T._trainer_against_bad_receivers(a, b)

def test_x():
    wrong_spec = dataclasses.replace(T.SPEC, num_query_groups=4)
    with start_hf_receiver(tiny_llama.build_hf, (wrong_spec,)) as wrong, start_hf_receiver(tiny_llama.build_hf, (T.SPEC,), die_after=2) as dying:
        print(run_on_ranks(body, 1, args=(wrong.address, dying.address), backend="gloo", timeout=100))
