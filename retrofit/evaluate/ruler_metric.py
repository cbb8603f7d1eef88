"""RULER's scorers, with no imports: `retrofit eval --export-harness` copies this file as the tasks' utils.py,
so lm-evaluation-harness scores the exported instances with the very code `retrofit eval` uses.

string_match_all: the fraction of the references found in the output (niah, vt, cwe, fwe);
string_match_part: 1 if any reference is found (RULER's QA tasks). Both case-insensitive substring matches.
"""


def string_match_all(prediction: str, references: list) -> float:
    """Fraction of `references` that occur in `prediction`, ignoring case."""
    text = prediction.lower()
    return sum(str(r).lower() in text for r in references) / len(references)


def string_match_part(prediction: str, references: list) -> float:
    """1.0 when any of `references` occurs in `prediction` (ignoring case), else 0.0."""
    text = prediction.lower()
    return float(any(str(r).lower() in text for r in references))


def process_results(doc: dict, results: list) -> dict:
    """lm-eval's per-document metric: the generated text scored against doc["outputs"]."""
    return {"score": string_match_all(results[0], doc["outputs"])}
