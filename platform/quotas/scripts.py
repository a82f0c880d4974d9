"""The quota scripts (Lua, in lua/): admission and fair share here; the settle, which a worker runs
too, with its reservation keys in contract/settle.py."""

from functools import cache
from pathlib import Path

from redis.commands.core import Script

from config.redis_client import get_redis
from contract import settle

_LUA = Path(__file__).resolve().parent / "lua"

# Scripts made of others, so that one round trip does what each does alone: each part becomes a
# local function of (KEYS, ARGV) ahead of the script's own text.
_PARTS = {"admit_and_take_slot": ("admit", "fair_acquire")}


@cache
def lua_source(name: str) -> str:
    if name == "settle":
        return settle.lua_source(name)
    parts = "".join(
        f"local function {part}(KEYS, ARGV)\n{(_LUA / f'{part}.lua').read_text()}\nend\n"
        for part in _PARTS.get(name, ())
    )
    return parts + (_LUA / f"{name}.lua").read_text()


@cache
def quota_script(name: str) -> Script:
    return get_redis().register_script(lua_source(name))
