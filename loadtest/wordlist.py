"""Common English words, most frequent first, for the synthetic MS MARCO-shaped generator.

The order is the rank used by the Zipf-like sampler in datasets.py: index 0 is the most likely.
Function words come first (as in real text), then everyday nouns, verbs and adjectives.
"""
from __future__ import annotations

_TEXT = """
the of and to a in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there been one all we their has would when if can more no
will so what about up out who them some into only other time new could these two may then do
first any my now such like our over man me even most made after also did many before must
through back years where much your way well down should because each just those people how too
little state good very make world still own see men work long get here between both life being
under never day same another know while last might us great old year off come since against go
came right used take three states himself few house use during without again place american
around however home small found thought went say part once general high upon school every
does got united left number course war until always away something fact though water less
public put think almost hand enough far took head yet government system better set told
nothing night end why called didn find look going asked later knew point next program city
business give group toward young days let room president side social present given several
order national possible rather second face per among form important often things looking
early white case john become large big need four within felt along children saw best church
ever least power development light thing seemed family interest want members mind country area
others done turned although open god service certain kind problem began different door thus
help means sense whole matter perhaps itself york times human law line above name example
action company hands local show whether five history gave today either act feet across taken
past quite anything seen having death week experience body word half really field am car
words already themselves information tell college shall money period held keep sure free
real probably seems behind cannot miss political air question making office brought whose
special heard major problems ago became federal moment study available known result street
economic boy reason change position south board individual job society areas west close turn
love community true court force full seem am policy age wife future voice center woman
common necessary control south book private rate sound type natural short process food
stage health price cost medical treatment symptoms cause disease blood heart pain skin
average salary temperature weather climate definition meaning population capital river
county island mountain ocean animal plant species energy protein vitamin calories diet
weight height distance miles hours minutes phone number address tax insurance credit loan
bank account card payment employee employer degree university student teacher course class
software computer internet website email password file data network server device battery
engine vehicle price purchase store product brand market industry company stock share
recipe chicken cheese bread sugar salt oil rice egg milk coffee tea fruit apple orange
dog cat bird fish horse baby child mother father brother sister name born died married
"""

WORDS: tuple[str, ...] = tuple(dict.fromkeys(_TEXT.split()))

# Question openers MS MARCO queries start with (lowercase, no question mark, as in the dataset).
QUERY_OPENERS: tuple[str, ...] = (
    "what is", "how much", "how to", "what does", "where is", "how long", "define", "who is",
    "when did", "what are", "why do", "is", "can you", "which",
)
