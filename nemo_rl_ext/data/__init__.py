"""Records, datasets, the chat renderer and tool-call parsing: the bottom layer (imports no other package of ours
except `config`)."""
