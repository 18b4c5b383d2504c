"""Generated math text with worked solutions (arithmetic, algebra, number theory).

No math corpus can be downloaded, so problems are generated from a seeded RNG
and every number is computed, not templated, so each worked solution is
correct. Documents mix several problem types so the domain is not one pattern.
"""

from __future__ import annotations

import math
import random
from fractions import Fraction
from typing import Callable

Problem = tuple[str, str]  # (statement, worked solution ending with the answer)


def _add(r: random.Random) -> Problem:
    nums = [r.randint(10, 10 ** r.randint(2, 6)) for _ in range(r.randint(2, 4))]
    steps, total = [], nums[0]
    for n in nums[1:]:
        steps.append(f"{total} + {n} = {total + n}")
        total += n
    return f"Compute {' + '.join(map(str, nums))}.", "Add left to right:\n" + "\n".join(steps) + f"\nAnswer: {total}"


def _sub(r: random.Random) -> Problem:
    a, b = r.randint(100, 99999), r.randint(10, 9999)
    return f"What is {a} - {b}?", f"{a} - {b} = {a - b}.\nAnswer: {a - b}"


def _mul(r: random.Random) -> Problem:
    a, b = r.randint(12, 9999), r.randint(12, 999)
    parts, place, lines = [], 1, []
    for digit in reversed(str(b)):
        d = int(digit)
        parts.append(a * d * place)
        lines.append(f"{a} x {d * place} = {a * d * place}")
        place *= 10
    assert sum(parts) == a * b
    return (
        f"Multiply {a} by {b}.",
        f"Split {b} by place value and multiply each part:\n" + "\n".join(lines)
        + f"\nSum of partial products: {' + '.join(map(str, parts))} = {a * b}\nAnswer: {a * b}",
    )


def _div(r: random.Random) -> Problem:
    b = r.randint(3, 97)
    q, rem = r.randint(10, 9999), r.randint(0, b - 1)
    a = b * q + rem
    return (
        f"Divide {a} by {b}. Give the quotient and remainder.",
        f"{b} x {q} = {b * q}, and {a} - {b * q} = {rem}, which is less than {b}.\n"
        f"Check: {b} x {q} + {rem} = {a}.\nAnswer: quotient {q}, remainder {rem}",
    )


def _expr(r: random.Random) -> Problem:
    a, b, c, d = (r.randint(2, 30) for _ in range(4))
    op1, op2 = r.choice("+-"), r.choice("+-")
    inner = a + b if op1 == "+" else a - b
    prod = inner * c
    result = prod + d if op2 == "+" else prod - d
    return (
        f"Evaluate ({a} {op1} {b}) x {c} {op2} {d}.",
        f"Parentheses first: {a} {op1} {b} = {inner}.\nThen multiply: {inner} x {c} = {prod}.\n"
        f"Finally: {prod} {op2} {d} = {result}.\nAnswer: {result}",
    )


def _frac(r: random.Random) -> Problem:
    a, b, c, d = r.randint(1, 12), r.randint(2, 15), r.randint(1, 12), r.randint(2, 15)
    op = r.choice("+-x")
    x, y = Fraction(a, b), Fraction(c, d)
    if op == "x":
        res = x * y
        sol = f"Multiply numerators and denominators: ({a} x {c})/({b} x {d}) = {a * c}/{b * d}."
    else:
        lcd = b * d // math.gcd(b, d)
        na, nc = a * (lcd // b), c * (lcd // d)
        num = na + nc if op == "+" else na - nc
        res = x + y if op == "+" else x - y
        sol = (
            f"The least common denominator of {b} and {d} is {lcd}.\n"
            f"{a}/{b} = {na}/{lcd} and {c}/{d} = {nc}/{lcd}.\n{na}/{lcd} {op} {nc}/{lcd} = {num}/{lcd}."
        )
    assert res == (x * y if op == "x" else (x + y if op == "+" else x - y))
    return f"Compute {a}/{b} {op} {c}/{d} and simplify.", sol + f"\nIn lowest terms: {res}\nAnswer: {res}"


def _percent(r: random.Random) -> Problem:
    p, base = r.choice([5, 10, 12, 15, 20, 25, 30, 40, 50, 75]), r.randrange(20, 5000, 4)
    val = Fraction(p * base, 100)
    new = base + val if r.random() < 0.5 else base - val
    verb = "increases" if new > base else "decreases"
    return (
        f"A price of {base} {verb} by {p}%. What is the new price?",
        f"{p}% of {base} is {p}/100 x {base} = {float(val):g}.\n"
        f"New price: {base} {'+' if new > base else '-'} {float(val):g} = {float(new):g}.\nAnswer: {float(new):g}",
    )


def _linear(r: random.Random) -> Problem:
    x = r.randint(-20, 20)
    a, c = r.sample([k for k in range(-9, 10) if k != 0], 2)
    b = r.randint(-50, 50)
    d = a * x + b - c * x
    return (
        f"Solve for x: {a}x + {b} = {c}x + {d}.",
        f"Move the x terms to the left: ({a} - {c})x = {d} - {b}.\nSo {a - c}x = {d - b}.\n"
        f"Divide by {a - c}: x = {Fraction(d - b, a - c)}.\nCheck: {a}({x}) + {b} = {a * x + b} and "
        f"{c}({x}) + {d} = {c * x + d}.\nAnswer: x = {x}",
    )


def _system(r: random.Random) -> Problem:
    x, y = r.randint(-12, 12), r.randint(-12, 12)
    while True:
        a, b, c, d = (r.randint(-7, 7) for _ in range(4))
        if a * d - b * c != 0 and a != 0:
            break
    e, f = a * x + b * y, c * x + d * y
    det = a * d - b * c
    return (
        f"Solve the system: {a}x + {b}y = {e} and {c}x + {d}y = {f}.",
        f"The determinant is ({a})({d}) - ({b})({c}) = {det}.\n"
        f"By Cramer's rule, x = (({e})({d}) - ({b})({f}))/{det} = {e * d - b * f}/{det} = {x},\n"
        f"and y = (({a})({f}) - ({e})({c}))/{det} = {a * f - e * c}/{det} = {y}.\nAnswer: x = {x}, y = {y}",
    )


def _quadratic(r: random.Random) -> Problem:
    p, q = r.randint(-15, 15), r.randint(-15, 15)
    s, prod = p + q, p * q
    disc = s * s - 4 * prod
    b_term = f"{'-' if s > 0 else '+'} {abs(s)}x" if s else ""
    c_term = f"{'+' if prod >= 0 else '-'} {abs(prod)}"
    roots = f"x = {min(p, q)} or x = {max(p, q)}" if p != q else f"x = {p} (a double root)"
    return (
        f"Solve x^2 {b_term} {c_term} = 0.".replace("  ", " "),
        f"We need two numbers with sum {s} and product {prod}: {p} and {q}.\n"
        f"So the equation factors as (x - {p})(x - {q}) = 0.\n"
        f"Discriminant check: {s}^2 - 4({prod}) = {disc}, and sqrt({disc}) = {math.isqrt(disc)}.\n"
        f"Answer: {roots}",
    )


def _gcd(r: random.Random) -> Problem:
    g = r.randint(1, 60)
    a, b = g * r.randint(2, 400), g * r.randint(2, 400)
    steps, x, y = [], max(a, b), min(a, b)
    while y:
        steps.append(f"{x} = {x // y} x {y} + {x % y}")
        x, y = y, x % y
    lcm = a * b // x
    return (
        f"Find gcd({a}, {b}) and lcm({a}, {b}).",
        "Euclid's algorithm:\n" + "\n".join(steps) + f"\nThe last nonzero remainder is {x}, so gcd = {x}.\n"
        f"lcm = {a} x {b} / {x} = {lcm}.\nAnswer: gcd = {x}, lcm = {lcm}",
    )


def _factor(r: random.Random) -> Problem:
    n = r.randint(30, 200000)
    m, f, steps, fs = n, 2, [], []
    while f * f <= m:
        while m % f == 0:
            steps.append(f"{m} / {f} = {m // f}")
            fs.append(f)
            m //= f
        f += 1
    if m > 1:
        fs.append(m)
        steps.append(f"{m} is prime")
    assert math.prod(fs) == n
    return f"Find the prime factorization of {n}.", "\n".join(steps) + f"\nAnswer: {n} = {' x '.join(map(str, fs))}"


def _modpow(r: random.Random) -> Problem:
    a, k, m = r.randint(2, 50), r.randint(5, 200), r.randint(7, 101)
    lines, result, base, e = [f"Write {k} in binary: {bin(k)[2:]}."], 1, a % m, k
    while e:
        if e & 1:
            lines.append(f"bit 1: result = {result} x {base} mod {m} = {result * base % m}")
            result = result * base % m
        e >>= 1
        if e:
            lines.append(f"square: {base}^2 mod {m} = {base * base % m}")
            base = base * base % m
    assert result == pow(a, k, m)
    return f"Compute {a}^{k} mod {m}.", "Use repeated squaring.\n" + "\n".join(lines) + f"\nAnswer: {result}"


def _prime(r: random.Random) -> Problem:
    n = r.randint(50, 20000) | 1
    root = math.isqrt(n)
    div = next((d for d in range(3, root + 1, 2) if n % d == 0), None)
    if div:
        sol = f"{n} is odd; trying odd divisors up to sqrt({n}) ~ {root}: {n} = {div} x {n // div}.\nAnswer: not prime"
    else:
        sol = f"{n} is odd and no odd number from 3 to {root} divides it.\nAnswer: {n} is prime"
    return f"Is {n} a prime number?", sol


def _series(r: random.Random) -> Problem:
    if r.random() < 0.5:
        a, d, n = r.randint(-10, 30), r.randint(1, 12), r.randint(5, 60)
        last = a + (n - 1) * d
        total = n * (a + last) // 2
        assert total == sum(a + i * d for i in range(n))
        return (
            f"Find the sum of the first {n} terms of the arithmetic sequence {a}, {a + d}, {a + 2 * d}, ...",
            f"The last term is {a} + ({n} - 1)({d}) = {last}.\nSum = n(first + last)/2 = {n}({a} + {last})/2 = {total}."
            f"\nAnswer: {total}",
        )
    a, q, n = r.randint(1, 9), r.randint(2, 5), r.randint(3, 12)
    total = a * (q**n - 1) // (q - 1)
    assert total == sum(a * q**i for i in range(n))
    return (
        f"Sum the geometric series {a} + {a * q} + {a * q * q} + ... with {n} terms.",
        f"Sum = a(r^n - 1)/(r - 1) = {a}({q}^{n} - 1)/({q} - 1) = {a}({q**n - 1})/{q - 1} = {total}.\nAnswer: {total}",
    )


def _base(r: random.Random) -> Problem:
    n, base = r.randint(10, 5000), r.choice([2, 8, 16])
    digits, m, lines = "", n, []
    while m:
        lines.append(f"{m} / {base} = {m // base} remainder {m % base}")
        digits = "0123456789ABCDEF"[m % base] + digits
        m //= base
    assert int(digits, base) == n
    return (
        f"Convert {n} to base {base}.",
        "Divide repeatedly and read the remainders from bottom to top:\n" + "\n".join(lines) + f"\nAnswer: {digits}",
    )


def _choose(r: random.Random) -> Problem:
    n = r.randint(5, 25)
    k = r.randint(1, n - 1)
    val = math.comb(n, k)
    return (
        f"How many ways can a committee of {k} be chosen from {n} people?",
        f"Order does not matter, so the count is C({n}, {k}) = {n}! / ({k}! x {n - k}!) = {val}.\nAnswer: {val}",
    )


def _rate(r: random.Random) -> Problem:
    speed, hours = r.randint(20, 120), r.randint(2, 9)
    extra = r.randint(1, 5)
    dist = speed * hours
    new_t = Fraction(dist, speed + 10 * extra)
    return (
        f"A train covers {dist} km in {hours} hours. How long would the trip take at {speed + 10 * extra} km/h?",
        f"Its speed is {dist} / {hours} = {speed} km/h. At {speed + 10 * extra} km/h the time is "
        f"{dist} / {speed + 10 * extra} = {new_t} hours (about {float(new_t):.2f}).\nAnswer: {new_t} hours",
    )


GENERATORS: tuple[tuple[str, Callable[[random.Random], Problem]], ...] = (
    ("addition", _add), ("subtraction", _sub), ("multiplication", _mul), ("division", _div),
    ("order of operations", _expr), ("fractions", _frac), ("percentages", _percent),
    ("linear equations", _linear), ("systems of equations", _system), ("quadratics", _quadratic),
    ("gcd and lcm", _gcd), ("prime factorization", _factor), ("modular arithmetic", _modpow),
    ("primality", _prime), ("series", _series), ("number bases", _base), ("combinatorics", _choose),
    ("rates", _rate),
)


def math_document(r: random.Random) -> str:
    """One worksheet: 4-10 problems from 1-3 topics, each with a worked solution."""
    topics = r.sample(GENERATORS, r.randint(1, 3))
    header = r.choice(["Worked examples", "Practice problems with solutions", "Exercises", "Solved problems"])
    lines = [f"{header}: {', '.join(t for t, _ in topics)}", ""]
    for i in range(1, r.randint(4, 10) + 1):
        _, gen = r.choice(topics)
        statement, solution = gen(r)
        q, s = r.choice([("Problem", "Solution"), ("Question", "Answer key"), ("Exercise", "Worked solution")])
        lines += [f"{q} {i}. {statement}", f"{s}:", solution, ""]
    return "\n".join(lines)
