"""Loaded at start-up by every Python process that has this folder on PYTHONPATH (benchmarks/
request_path.py sets it for `shepherd serve`, whose engine-core process inherits it).

With SHEPHERD_PATH_TRACE=DIR it installs a profile hook in every thread that stays idle until
SIGUSR1; from then on each call into a shepherd file is counted with the file of its direct
caller (a library's frame, such as the event loop's, counts as "(outside)"), until SIGUSR2
writes DIR/<pid>.json: the files entered and the caller -> callee hand-offs, with counts."""
import os

_DIR = os.environ.get("SHEPHERD_PATH_TRACE")

if _DIR:
    import json
    import signal
    import sys
    import threading
    from collections import Counter

    _on = False
    _files: Counter = Counter()
    _edges: Counter = Counter()
    _order: list = []
    _MARK = os.sep + "shepherd" + os.sep

    def _rel(path):
        i = path.rfind(_MARK)
        return path[i + 1:] if i >= 0 and path.endswith(".py") else None

    def _hook(frame, event, arg):
        if not _on or event != "call":
            return
        callee = _rel(frame.f_code.co_filename)
        if callee is None:
            return
        _files[callee] += 1
        back = frame.f_back         # the direct caller: a library (the event loop, uvicorn) is "outside"
        caller = _rel(back.f_code.co_filename) if back is not None else None
        if caller != callee:
            edge = (caller or "(outside)", callee)
            if edge not in _edges:
                _order.append(edge)
            _edges[edge] += 1

    def _start(*_):
        global _on
        _files.clear()
        _edges.clear()
        _order.clear()
        _on = True

    def _dump(*_):
        global _on
        _on = False
        with open(os.path.join(_DIR, f"{os.getpid()}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "argv": sys.argv, "files": dict(_files),
                       "edges": [[a, b, _edges[(a, b)]] for a, b in _order]}, f, indent=1)

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _dump)
    sys.setprofile(_hook)
    threading.setprofile(_hook)
