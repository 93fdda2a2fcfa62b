import pytest

from expstore_rl.tokenizer import CharTokenizer


def test_ids_of_the_fixed_vocabulary():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.encode("<tool></tool><obs></obs>") == [3, 4, 5, 6]
    assert tok.encode("0") == [7] and tok.encode("z") == [tok.vocab_size - 1]
    assert tok.vocab_size == 51


def test_round_trip_with_special_tokens_written_literally():
    tok = CharTokenizer()
    text = "<bos>12*7=<tool>calc 12*7</tool><obs>84</obs>84<eos>"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text


def test_unknown_character_is_an_error():
    with pytest.raises(ValueError, match="'A'"):
        CharTokenizer().encode("A")


@pytest.mark.parametrize("bad", [51, 40321, -1])
def test_an_id_outside_the_vocabulary_is_an_error_that_names_it(bad):
    # a row tokenized by another tokenizer (ids of a 50k vocabulary): not an IndexError,
    # and a negative id must not decode as a character from the end of the table
    with pytest.raises(ValueError, match=rf"token id {bad} is not in the CharTokenizer vocabulary \(ids 0-50\)"):
        CharTokenizer().decode([7, bad])
