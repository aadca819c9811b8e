from tensorshare.compat import TensorShare
from threading import Thread
import torch


def do_something(ts):
    ts.put('data_bin', dict(a=torch.randn(2, 2), version=0))  # Not blocking
    ts.peek('data_bin', lambda x: print('peek data_bin', x))  # Get data in the bin and it
    
    # Alternatively specify a callback
    def cb_get_data(response):
        ts.get('xyz', lambda x: print('get xyz', x))  # This is called as soon as the server responds
    ts.put('xyz', dict(a=torch.randn(2, 2), version=0), callback=cb_get_data)

    # Listening to data bins
    def cb_bin_updated(msg):
        if 'bin' in msg.keys():
            print('Bin', msg['bin'], 'updated. Num items: ', msg['n_items'])
    ts.listen('xyz', cb_bin_updated)    # Listen to changes in bin xyz, calling cb_bin_updated whenever it happens 
    ts.append('xyz', torch.randn(2, 2))    # Appending will not overwrite data in the bin, but append to it, creating a list
    ts.append('xyz', torch.randn(2, 2))
    ts.get('xyz', lambda x: print('get xyz', x))   # Get removes data in the bin, which will also emit a notification.
    ts.put('xyz', torch.randn(2, 2))
    
    def cb_print_and_exit(resp):
        print(resp)
        ts.stop()
    ts.list(cb_print_and_exit)  # List the number of items in all bins 

    
tmp = TensorShare('localhost', 8000)
Thread(target=do_something, args=(tmp, ), daemon=True).start()
tmp.start() # This is blocking and must be started in the main thread.
