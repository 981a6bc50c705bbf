"""The call server of function tests (rewards.check_function): limits and the privilege drop first, then the
solution, then one reply per call; arguments and results cross as plain data (plain.py), the check itself
stays with the scorer."""

import marshal
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the program's own folder off sys.path
from limit import limit, params, unpack  # noqa: E402
from plain import decode_plain, encode_plain  # noqa: E402

unpack()
channel_in, channel_out = os.fdopen(os.dup(0), "rb"), os.dup(1)
null = os.open(os.devnull, os.O_RDWR)
os.dup2(null, 0)  # the solution's reads and prints must not touch the channel: its stdout goes to
os.dup2(2, 1)  # the scorer's other pipe (counted against the output cap), its stderr nowhere
os.dup2(null, 2)
limit(*params["limits"])
sys.argv = ["main.py"]


def as_json(x):  # encode_plain's output is lists, ASCII strings, None and booleans
    if x is None or type(x) is bool:
        return "null" if x is None else "true" if x else "false"
    return '"' + x + '"' if type(x) is str else "[" + ",".join(map(as_json, x)) + "]"


def reply(kind, body=None):
    data = ("[" + as_json(kind) + "," + as_json(body) + "]\n").encode()
    while data:
        data = data[os.write(channel_out, data):]


def request():  # the scorer's own data, length-prefixed marshal
    head = channel_in.read(8)
    return marshal.loads(channel_in.read(int.from_bytes(head, "little"))) if len(head) == 8 else None


ns = {"__name__": "solution"}
try:
    exec(compile(open("prelude.py").read(), "prelude.py", "exec"), ns)
    exec(compile(open("main.py").read(), "solution.py", "exec"), ns)
    entry = ns[params["entry_point"]]


except BaseException:
    os._exit(1)


objects = []  # instances the entry point made, when it is a class (LiveCodeBench's Solution)
reply("ready")
while (call := request()) is not None:
    target, args, kwargs = call
    try:
        fn = entry if target is None else getattr(objects[target[0]], target[1])
        result = fn(*decode_plain(args), **decode_plain(kwargs))
    except BaseException as e:
        try:
            message = str(e)[:1000]
        except BaseException:
            message = ""
        reply("raised", encode_plain((type(e).__name__, message)))
        continue
    try:
        reply("value", encode_plain(result))
    except (ValueError, RecursionError):
        if target is None and isinstance(entry, type) and type(result) is entry:
            objects.append(result)
            reply("object", str(len(objects) - 1))
        else:
            reply("unplain")
