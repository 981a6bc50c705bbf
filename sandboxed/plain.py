"""Plain data across the sandbox's boundary, both ways: the scorer encodes a test's arguments and decodes
the results, the call server (call_server.py) the reverse. A strict encoding of builtin types only: an
object equal to everything, an int subclass, a patched builtin cannot cross."""


def encode_plain(x: object, depth: int = 0) -> object:
    """x as tagged data (lists, ASCII strings, None, booleans): None, bool, int, float (inf and nan
    too), complex, str, bytes, and lists, tuples, sets, frozensets and dicts of these, each keeping
    its type. An instance of a subclass (Counter, namedtuple, IntEnum) is encoded as its builtin
    base's value: what it overrides (an __eq__ that is always True) stays behind. ValueError for
    anything else."""
    if x is None or type(x) is bool:
        return x
    if depth > 100:
        raise ValueError("nested too deeply")
    if isinstance(x, str):
        return ["u", str.encode(x, "utf-8", "surrogatepass").hex()]
    if isinstance(x, int):
        return ["i", hex(int.__int__(x))]
    if isinstance(x, float):
        return ["f", float.hex(x)]
    if isinstance(x, complex):
        return ["c", [float.hex(x.real), float.hex(x.imag)]]
    if isinstance(x, bytes):
        return ["b", bytes.hex(x)]
    if isinstance(x, dict):
        return ["d", [[encode_plain(k, depth + 1), encode_plain(v, depth + 1)] for k, v in dict.items(x)]]
    for base, tag in ((list, "l"), (tuple, "t"), (set, "s"), (frozenset, "fs")):
        if isinstance(x, base):
            return [tag, [encode_plain(v, depth + 1) for v in base.__iter__(x)]]
    raise ValueError(f"not plain data: {type(x).__name__}")


def decode_plain(x: object, depth: int = 0) -> object:
    """The value encode_plain described, built from builtin types only; ValueError (or TypeError for
    an unhashable key) for anything else, whatever the sender wrote."""
    if x is None or type(x) is bool:
        return x
    if type(x) is not list or len(x) != 2 or type(x[0]) is not str or depth > 100:
        raise ValueError("not an encoded value")
    tag, body = x
    if tag == "u" and type(body) is str:
        return bytes.fromhex(body).decode("utf-8", "surrogatepass")
    if tag in ("i", "f", "b") and type(body) is str:
        return int(body, 16) if tag == "i" else float.fromhex(body) if tag == "f" else bytes.fromhex(body)
    if tag == "c" and type(body) is list and [type(v) for v in body] == [str, str]:
        return complex(float.fromhex(body[0]), float.fromhex(body[1]))
    if type(body) is not list:
        raise ValueError("not an encoded value")
    if tag == "d":
        if not all(type(kv) is list and len(kv) == 2 for kv in body):
            raise ValueError("not an encoded dict")
        return {decode_plain(k, depth + 1): decode_plain(v, depth + 1) for k, v in body}
    items = [decode_plain(v, depth + 1) for v in body]
    if tag == "l":
        return items
    if tag == "t":
        return tuple(items)
    if tag == "s":
        return set(items)
    if tag == "fs":
        return frozenset(items)
    raise ValueError(f"unknown tag {tag!r}")
