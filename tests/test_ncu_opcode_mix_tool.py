"""CPU test of csrc/cuda/tests/ncu_opcode_mix.py: executed instructions per opcode from Nsight Compute's SASS
source-page CSV (predicates and modifiers dropped, thousands separators read), and the table ranked by the
largest difference from the first kernel."""

from tool_scripts import load_tool


def test_opcode_counts_and_ranking(tmp_path, capsys, monkeypatch):
    tool = load_tool("ncu_opcode_mix.py")
    ours = tmp_path / "ours.csv"
    ours.write_text('"Kernel Name","forward_kernel"\n'
                    '"# Address","Source","Instructions Executed","Warp Stall Sampling (All Samples)"\n'
                    '"0x10","@!P0  BRA 0x7f10","1,000","5"\n'
                    '"0x20","HGMMA.64x64x16.F32.BF16 R56, gdesc[UR28], RZ, !UPT","200","1"\n'
                    '"0x30","FMNMX R14, R13, R12, !PT","3,000","2"\n'
                    '"0x40","@P1 FMNMX R15, R14, R12, !PT","500","0"\n')
    theirs = tmp_path / "theirs.csv"
    theirs.write_text('"# Address","Source","Instructions Executed"\n'
                      '"0x10","BRA 0x7f10","10"\n'
                      '"0x30","FMNMX R14, R13, R12, !PT","3,400"\n'
                      '"0x40","MUFU.EX2 R1, R1","n/a"\n')
    counts = tool.opcode_counts(str(ours))
    assert counts == {"BRA": 1000, "HGMMA": 200, "FMNMX": 3500}
    assert tool.opcode_counts(str(theirs)) == {"BRA": 10, "FMNMX": 3400, "MUFU": 0}
    monkeypatch.setattr("sys.argv", ["ncu_opcode_mix.py", f"ours={ours}", f"theirs={theirs}", "--top", "3"])
    tool.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["opcode", "ours", "theirs"]
    assert lines[1].split() == ["total", "4,700", "3,410"]
    assert [line.split()[0] for line in lines[2:]] == ["BRA", "HGMMA", "FMNMX"]
